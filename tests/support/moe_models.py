"""Tiny mixture-of-experts models (random init, float64) and their batches, for the load-balancing tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import engine
from tests.support.reference import DTYPE

VOCAB, SEQ = 32, 6
COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32, output_router_logits=True,
              experts_implementation="eager", attn_implementation="sdpa")


def hf_moe(kind: str = "mixtral", seed: int = 0, coef: float = 0.02, kv_heads: int = 1, **overrides) -> torch.nn.Module:
    """A two-layer Hugging Face MoE language model of 4 experts, top-2 (Qwen2-MoE: with its shared expert)."""
    import transformers

    torch.manual_seed(seed)
    settings = dict(COMMON, router_aux_loss_coef=coef, num_key_value_heads=kv_heads)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **settings)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "olmoe":
        config = transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **settings)
        model = transformers.OlmoeForCausalLM(config)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                             shared_expert_intermediate_size=12, decoder_sparse_step=1, **settings)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        raise ValueError(kind)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    return model.to(DTYPE)


def lm_batches(steps: int, global_batch: int, *, padded: bool = False, seed: int = 3) -> list[dict]:
    """``{input_ids, attention_mask, labels}`` batches; ``padded``: rows of 2..SEQ real tokens, right
    padded (mask 0, label -100 there), very uneven between micro-batches."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (global_batch,), generator=g) if padded else torch.full((global_batch,), SEQ)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def hf_loss(model, batch):
    """The unchanged Hugging Face script: the model's own loss (mean over tokens + coefficient × term)."""
    return model(**batch).loss


def lm_sum_with_balance(coef: float):
    """The ``(sum, count)`` form: the language-model sum over real tokens plus the coefficient times
    the model's term (which counts once for the window), and the window's tokens."""
    def loss_fn(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"][:, 1:]
        lm_sum = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                 reduction="sum")
        return lm_sum + coef * out.aux_loss, (labels != -100).sum()
    return loss_fn


class OwnMoE(torch.nn.Module):
    """A model of one's own, float64 throughout: an embedding, two top-2 routers over 4 tiny experts, a
    head; it returns its logits and the term of :class:`engine.LoadBalancingLoss` over both routers."""

    coef = 0.05

    def __init__(self, seed: int = 0, width: int = 8, experts: int = 4):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.routers = torch.nn.ModuleList(torch.nn.Linear(width, experts, bias=False) for _ in range(2))
        self.experts = torch.nn.ModuleList(torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(experts))
                                           for _ in range(2))
        self.head = torch.nn.Linear(width, VOCAB)
        self.balance = engine.LoadBalancingLoss(num_experts=experts, top_k=2)
        self.to(DTYPE)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids).flatten(0, 1)
        logits_per_layer = []
        for router, experts in zip(self.routers, self.experts):
            logits = router(h)
            logits_per_layer.append(logits)
            weights, chosen = torch.softmax(logits, -1).topk(2, dim=-1)
            mixed = torch.zeros_like(h)
            for slot in range(2):
                for e, expert in enumerate(experts):
                    rows = chosen[:, slot] == e
                    mixed[rows] += weights[rows, slot, None] * torch.tanh(expert(h[rows]))
            h = h + mixed
        return self.head(h), self.balance(tuple(logits_per_layer), attention_mask)


def own_mean_loss(model, batch):
    """Mean over the micro-batch's real tokens + coefficient × term (the full batch's loss on the full batch)."""
    logits, aux = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits, batch["labels"].flatten(), ignore_index=-100) + OwnMoE.coef * aux


def own_sum_loss(model, batch):
    logits, aux = model(batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"].flatten()
    lm_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return lm_sum + OwnMoE.coef * aux, (labels != -100).sum()


def float64_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """Hugging Face's ``load_balancing_loss_func`` written again in the logits' precision (transformers
    accumulates it in float32): the float64 reference's term, independent of the engine's code."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    logits = torch.cat(gate_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).sum(1).to(probs.dtype)
    weight = torch.ones(logits.shape[0], dtype=probs.dtype) if attention_mask is None else \
        attention_mask.reshape(-1).to(probs.dtype).repeat(len(gate_logits))
    rows = weight.sum()
    share = (chosen * weight[:, None]).sum(0) / rows
    mean_prob = (probs * weight[:, None]).sum(0) / rows
    return num_experts * (share * mean_prob).sum()


class float64_term:
    """Inside the block ``model``'s modeling module computes its term with :func:`float64_balancing_loss`."""

    def __init__(self, model):
        import sys
        self.module = sys.modules[type(model).__module__]

    def __enter__(self):
        self.original = self.module.load_balancing_loss_func
        self.module.load_balancing_loss_func = float64_balancing_loss

    def __exit__(self, *exc):
        self.module.load_balancing_loss_func = self.original


def full_batch_loss(coef: float):
    """The full batch's loss as ``.loss`` defines it (mean over real tokens + coefficient × term), with the
    cross entropy in float64: transformers computes it in float32 (``logits.float()``), whose rounding
    depends on the token count and would hide an exact match with padding."""
    def loss_fn(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"][:, 1:]
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100) + \
            coef * out.aux_loss
    return loss_fn


def deepseek_v3(seed: int = 0) -> torch.nn.Module:
    """A two-layer Hugging Face DeepSeek-V3 (aux-loss-free routers holding e_score_correction_bias), 8
    experts top-2 in one group, the first layer dense as DeepSeek's are."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32, experts_implementation="eager",
        attn_implementation="sdpa")
    model = transformers.DeepseekV3ForCausalLM(config).to(DTYPE)
    with torch.no_grad():  # transformers starts the router weights at 0: every expert would tie
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.weight.normal_(0, 0.5)
    return model


def train_with_bias_updates(model, batches, loss_fn, speed: float, optimizer_factory):
    """The full-batch reference of aux-loss-free balancing: one optimizer step per global batch, then
    every router's bias moved by ``speed`` towards even load, the load counted in that batch's forward."""
    import copy

    model = copy.deepcopy(model)
    optimizer = optimizer_factory(model.parameters())
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    loads = {}

    def count(module, inputs, output):
        loads[module] = torch.bincount(output[2].flatten(), minlength=module.e_score_correction_bias.numel())

    handles = [router.register_forward_hook(count) for router in routers]
    for batch in batches:
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        optimizer.step()
        with torch.no_grad():
            for router in routers:
                load = loads[router].double()
                router.e_score_correction_bias += speed * torch.sign(load.mean() - load)
    for handle in handles:
        handle.remove()
    return model


class StackedExperts(torch.nn.Module):
    """Experts held as one module, Hugging Face's form: parameters ``[num_experts, ...]`` and
    ``forward(hidden_states, top_k_index, top_k_weights)``, each row the weighted sum of its experts."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.num_experts = experts
        self.weight = torch.nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(experts, width) / 10)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            if len(rows):
                y = torch.tanh(hidden_states[rows] @ self.weight[e].T + self.bias[e])
                out = out.index_add(0, rows, y * top_k_weights[rows, slot, None])
        return out


class StackedMoE(torch.nn.Module):
    """A model of one's own with :class:`StackedExperts` (named ``blocks.<i>.experts``, for
    ``expert_parallel.modules``) and :class:`engine.LoadBalancingLoss`. Its routers prefer experts 0 and
    1 by ``preference`` for token ids below ``VOCAB // 2``: a batch of such ids sends no token to 2 and 3."""

    coef = 0.05

    def __init__(self, seed: int = 0, width: int = 8, experts: int = 4, preference: float = 20.0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.routers = torch.nn.ModuleList(torch.nn.Linear(width, experts, bias=False) for _ in range(2))
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for block in self.blocks:
            block.experts = StackedExperts(experts, width)
        table = torch.zeros(VOCAB, experts)
        table[:VOCAB // 2, :2] = preference
        self.register_buffer("preference", table)
        self.head = torch.nn.Linear(width, VOCAB)
        self.balance = engine.LoadBalancingLoss(num_experts=experts, top_k=2)
        self.to(DTYPE)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids).flatten(0, 1)
        bias = self.preference[input_ids.flatten()]
        logits_per_layer = []
        for router, block in zip(self.routers, self.blocks):
            logits = router(h) + bias
            logits_per_layer.append(logits)
            weights, chosen = torch.softmax(logits, -1).topk(2, dim=-1)
            h = h + block.experts(h, chosen, weights)
        return self.head(h), self.balance(tuple(logits_per_layer), attention_mask)


def stacked_mean_loss(model, batch):
    logits, aux = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits, batch["labels"].flatten(), ignore_index=-100) + StackedMoE.coef * aux


def stacked_sum_loss(model, batch):
    logits, aux = model(batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"].flatten()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") + StackedMoE.coef * aux, \
        (labels != -100).sum()
