from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch

from engine.batching.microbatch import BatchError, batch_size, split_batch, to_device

Pair = namedtuple("Pair", "x y")


class Encoding(UserDict):
    """Stands in for a Hugging Face BatchEncoding (a UserDict built from a dict)."""


def test_nested_batches_are_split_into_views_of_each_tensor():
    x = torch.arange(10.0).reshape(5, 2)
    batch = {"inputs": (x, Pair(x[:, 0], "tag")), "mask": OrderedDict(m=torch.ones(5)),
             "enc": Encoding({"ids": torch.arange(5)}), "scale": torch.tensor(2.0), "name": "run", "n": 3}
    assert batch_size(batch) == 5
    parts = split_batch(batch, (3, 2))
    assert [batch_size(p) for p in parts] == [3, 2]
    first = parts[0]
    assert torch.equal(first["inputs"][0], x[:3]) and first["inputs"][0].data_ptr() == x.data_ptr()
    assert isinstance(first["inputs"][1], Pair) and first["inputs"][1].y == "tag"
    assert isinstance(first["mask"], OrderedDict) and isinstance(first["enc"], Encoding)
    assert torch.equal(parts[1]["enc"]["ids"], torch.tensor([3, 4]))
    assert first["scale"] is batch["scale"] and first["name"] == "run" and first["n"] == 3


def test_mismatched_batch_dimensions_are_named():
    with pytest.raises(BatchError, match=r"batch\['a'\]: 4, batch\['b'\]: 3"):
        batch_size({"a": torch.zeros(4), "b": torch.zeros(3)})


def test_batch_without_tensors_is_an_error():
    with pytest.raises(BatchError, match="no tensor with a batch dimension"):
        batch_size({"a": 1, "b": torch.tensor(1.0)})


def test_sizes_that_do_not_cover_the_batch_are_refused():
    with pytest.raises(BatchError, match=r"cannot cut a batch of 5 samples into micro-batches \[2, 2\]"):
        split_batch(torch.zeros(5), (2, 2))


def test_to_device_moves_every_tensor_and_keeps_the_containers():
    Pair = namedtuple("Pair", "inputs labels")
    batch = {"pair": Pair(torch.ones(2, 3), [torch.zeros(2), "text"]), "step": 7}
    moved = to_device(batch, torch.device("meta"))
    assert isinstance(moved["pair"], Pair) and moved["step"] == 7 and moved["pair"].labels[1] == "text"
    assert moved["pair"].inputs.device.type == moved["pair"].labels[0].device.type == "meta"
    assert batch["pair"].inputs.device.type == "cpu"  # the caller's batch is left as it was
