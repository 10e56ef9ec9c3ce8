"""examples/deepspeed_style.py and examples/colossalai_style.py under `python -m launch
--nproc-per-node 2`, as a user runs them after the one-line change."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.dist_utils import repo_first_on_path

REPO = Path(__file__).resolve().parents[2]


def launch(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_first_on_path(REPO)}
    result = subprocess.run([sys.executable, "-m", "launch", "--nproc-per-node", "2", *argv], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    return result


def test_colossalai_tutorial_updates_only_at_iterations_3_and_7():
    out = launch("examples/colossalai_style.py").stdout
    # anchored at line starts: each rank writes whole lines, though torchrun runs it unbuffered
    assert sorted(re.findall(r"^rank (\d): parameter updated at iterations \[3, 7\] \(gradient_accumulation = 4\)$",
                             out, re.M)) == ["0", "1"], out
    assert len(re.findall(r"^iteration \d, loss: [\d.]+, first 10 elements of param: \[[^\n]*\]$", out, re.M)) == 8, out


def test_deepspeed_script_trains_saves_and_resumes(tmp_path):
    save_dir = tmp_path / "ckpt"
    out = launch("examples/deepspeed_style.py", "--deepspeed", "--save_dir", str(save_dir)).stdout
    losses = [float(x) for x in re.findall(r"^epoch \d: mean micro-batch loss ([\d.]+), lr", out, re.M)]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0] < 1.6, out
    # 512 samples, global batch 4 x 4 x 2 = 32: 16 optimizer steps per epoch
    assert "global step 48, samples 1536" in out
    assert f"saved and loaded {save_dir}/global_step48: client state {{'epoch': 2}}" in out
    assert (save_dir / "latest").read_text() == "global_step48"
