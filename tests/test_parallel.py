"""nanoagent/parallel.py and the multi-rank train.py: the same step on 1 or 2 ranks (gloo, FSDP2 on CPU),
sharded checkpoints and resume on another number of ranks, the samplers' update_weights from a sharded policy,
and fp32 master weights."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import train
from nanoagent.checkpoint import latest_checkpoint
from nanoagent.models import load_model
from tests.test_train import BANDIT

REPO = Path(__file__).resolve().parent.parent
# Small enough for two processes on a shared 2-core machine: 2 steps, 4 prompts x 4 samples. A small lr: AdamW
# divides by sqrt(v), so entries with tiny gradients (unused embedding rows) amplify float-rounding differences.
COMMON = BANDIT + ["--steps", "2", "--save_every", "1", "--lr", "1e-5", "--critic_lr", "1e-5"]
COMPARED = ["reward", "success", "group_reward_std", "policy_loss", "value_loss", "grad_norm", "entropy",
            "approx_kl", "clip_fraction", "logprob_mismatch", "kept_trajectories"]


def torchrun(script_and_args, timeout=600):
    """Run under torch.distributed.run with 2 CPU processes (gloo); fail with the ranks' stderr."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *script_and_args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(directory, auto_class=AutoModelForCausalLM):
    """An HF checkpoint directory loaded by transformers itself, as its state dict."""
    return auto_class.from_pretrained(directory).state_dict()


def assert_close_runs(one, two, atol=1e-5):
    """Two run directories: the same metrics each step and the same final weights (policy, critic), to atol."""
    for step_one, step_two in zip(metrics(one), metrics(two), strict=True):
        for key in COMPARED:
            assert step_one[key] == pytest.approx(step_two[key], abs=atol, rel=atol), (step_one["step"], key)
    final = latest_checkpoint(one).name
    pairs = [(one / final, two / final, AutoModelForCausalLM)]
    if (one / final / "critic").exists():
        pairs.append((one / final / "critic", two / final / "critic", AutoModelForTokenClassification))
    for directory_one, directory_two, auto_class in pairs:
        state_one, state_two = weights(directory_one, auto_class), weights(directory_two, auto_class)
        assert state_one.keys() == state_two.keys()
        for name in state_one:
            assert torch.allclose(state_one[name], state_two[name], atol=atol, rtol=0), name


@pytest.fixture(scope="module")
def warmed_up():
    train.warm_up(train.get_args(BANDIT))  # once here, so the ranks only read the cache


@pytest.mark.parametrize("flags", [
    ["--algo", "grpo"],
    ["--algo", "reinforce_pp"],
    ["--starpo_s", "--filter_ratio", "0.5"],  # PPO with a critic, groups ranked over both ranks' batches
    ["--algo", "grpo", "--kl", "loss", "--loss_agg", "seq-mean-token-mean", "--entropy_coef", "0.01"],
], ids=["grpo", "reinforce_pp", "starpo_s", "grpo_kl_seqmean"])
def test_two_ranks_take_the_same_step_as_one_process(flags, tmp_path, warmed_up):
    # Rollouts do not depend on the split (per-episode sampling seeds): the 2 ranks together see the one
    # process's batch. Anything left per rank (token counts, whitening, filtering, metrics) breaks equality.
    train.main(COMMON + flags + ["--out_dir", str(tmp_path / "one")])
    torchrun(["train.py", *COMMON, *flags, "--out_dir", str(tmp_path / "two")])
    assert metrics(tmp_path / "two")[-1]["kept_trajectories"] == (8 if "--starpo_s" in flags else 16)
    assert_close_runs(tmp_path / "one", tmp_path / "two")


def test_sharded_resume_is_exact_on_two_ranks_and_continues_on_one(tmp_path, warmed_up):
    flags = COMMON + ["--algo", "ppo"]  # one full-batch update a step: then 1 process equals 2 ranks
    torchrun(["train.py", *flags, "--out_dir", str(tmp_path / "straight")])
    # The checkpoint of a 2-rank run is an HF directory with the tie restored.
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "step_000002")
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    shutil.copytree(tmp_path / "straight", tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "step_000002")
    shutil.copytree(tmp_path / "broken", tmp_path / "on_one")
    torchrun(["train.py", *flags, "--out_dir", str(tmp_path / "broken"), "--resume"])  # 2 -> 2
    straight, resumed = weights(tmp_path / "straight" / "step_000002"), weights(tmp_path / "broken" / "step_000002")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    # 2 -> 1: the optimizer shards are resharded into one process, which continues the run as 2 ranks would
    # (AdamW without its state would take a different second step).
    train.main(flags + ["--out_dir", str(tmp_path / "on_one"), "--resume"])
    on_one = weights(tmp_path / "on_one" / "step_000002")
    for name in straight:
        assert torch.allclose(straight[name], on_one[name], atol=1e-5, rtol=0), name
    assert [step["step"] for step in metrics(tmp_path / "on_one")] == [1, 2]


PUSH_SCRIPT = """
import sys, torch, torch.distributed as dist
from nanoagent.models import load_model
from nanoagent.parallel import full_state_dict, shard_model
from nanoagent.sampler import TorchSampler
dist.init_process_group("gloo")
policy = shard_model(load_model("tiny")[0].train(), torch.device("cpu"))
sampler = TorchSampler(load_model("tiny")[0])
optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
input_ids = torch.arange(10, 30).view(2, 10) + 5 * dist.get_rank()
(policy(input_ids=input_ids).logits.square().mean() / 2).backward()  # summed over ranks
optimizer.step()
sampler.update_weights(policy, torch.float32)
gathered = full_state_dict(policy)
if dist.get_rank() == 0:
    torch.save(gathered, sys.argv[1] + "/gathered.pt")
torch.save(sampler.model.state_dict(), sys.argv[1] + f"/sampler-{dist.get_rank()}.pt")
dist.destroy_process_group()
"""


def test_weight_push_from_two_ranks_gives_every_sampler_the_full_weights(tmp_path):
    script = tmp_path / "push.py"
    script.write_text(PUSH_SCRIPT)
    torchrun([str(script), str(tmp_path)])
    gathered = torch.load(tmp_path / "gathered.pt")
    reference, _ = load_model("tiny")
    assert set(gathered) == set(reference.state_dict())  # the tied head too: vLLM keeps its own
    # One process, the same update on the same (concatenated) batch, on the plain model.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    input_ids = torch.cat([torch.arange(10, 30).view(2, 10), torch.arange(15, 35).view(2, 10)])
    reference(input_ids=input_ids).logits.square().mean().backward()
    optimizer.step()
    for rank in (0, 1):
        pushed = torch.load(tmp_path / f"sampler-{rank}.pt")
        assert torch.equal(pushed["lm_head.weight"], pushed["model.embed_tokens.weight"])
        for name, tensor in reference.state_dict().items():
            assert torch.equal(pushed[name], gathered[name]), name
            assert torch.allclose(pushed[name], tensor, atol=1e-6, rtol=0), name


def test_fp32_master_weights_move_at_lr_1e6_where_bf16_weights_do_not():
    # Defect 1 of pure-bf16 AdamW: a step below half a bf16 rounding unit leaves the weight where it was.
    # The fp32 master (what shard_model keeps, with bf16 compute) moves every entry.
    model, _ = load_model("tiny")
    input_ids = torch.randint(10, 800, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = {}
    for name, dtype in (("fp32 master", torch.float32), ("pure bf16", torch.bfloat16)):
        copy = type(model)(model.config).to(dtype)
        copy.load_state_dict(model.state_dict())
        layers = list(copy.model.layers.parameters())  # every entry gets a gradient (unlike unused embedding rows)
        before = [parameter.detach().clone() for parameter in layers]
        optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-6, weight_decay=0.0)
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 compute either way
                loss = copy(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        moved = sum((after != start).sum().item() for after, start in zip(layers, before))
        changed[name] = moved / sum(parameter.numel() for parameter in layers)
    assert changed["fp32 master"] > 0.9 and changed["pure bf16"] < 0.1, changed
