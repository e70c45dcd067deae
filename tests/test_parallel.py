"""nanoagent/parallel.py and the multi-rank train.py: the same step on 1 or 2 ranks (gloo, FSDP2 on CPU),
sharded checkpoints and resume on another number of ranks, the samplers' update_weights from a sharded policy,
and fp32 master weights."""

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import train
from nanoagent.checkpoint import latest_checkpoint
from nanoagent.models import load_critic, load_model
from tests.conftest import import_or_skip_outside_ci
from tests.test_train import BANDIT

REPO = Path(__file__).resolve().parent.parent
# Small enough for two processes on a shared 2-core machine: 2 steps, 4 prompts x 4 samples. A small lr: AdamW
# divides by sqrt(v), so entries with tiny gradients (unused embedding rows) amplify float-rounding differences.
COMMON = BANDIT + ["--steps", "2", "--save_every", "1", "--lr", "1e-5", "--critic_lr", "1e-5"]
COMPARED = ["reward", "success", "group_reward_std", "policy_loss", "value_loss", "grad_norm", "entropy",
            "approx_kl", "clip_fraction", "logprob_mismatch", "kept_trajectories", "approx_kl_max",
            "clip_fraction_max", "zero_variance_groups", "void_turns", "retrieval_accuracy", "mutual_information"]


def torchrun(script_and_args, timeout=600):
    """Run under torch.distributed.run with 2 CPU processes (gloo); fail with the ranks' stderr."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *script_and_args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def stored_tensors(directory):
    """{name: (dtype, shape)} of the tensors in an HF directory's model.safetensors."""
    with safe_open(Path(directory) / "model.safetensors", "pt") as stored:
        return {name: (stored.get_slice(name).get_dtype(), stored.get_slice(name).get_shape())
                for name in stored.keys()}


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
    ["--algo", "grpo", "--lora_rank", "4"],  # adapters sharded with their layers, the sampler's copy given the merge
], ids=["grpo", "reinforce_pp", "starpo_s", "grpo_kl_seqmean", "grpo_lora"])
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
    # The checkpoint of a 2-rank run is an HF directory with the tie restored, and the head stored once, as an
    # unsharded save_pretrained writes it.
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "step_000002")
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    policy.save_pretrained(tmp_path / "unsharded")
    assert stored_tensors(tmp_path / "straight" / "step_000002") == stored_tensors(tmp_path / "unsharded")
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
    assert set(gathered) == set(reference.state_dict()) - {"lm_head.weight"}  # the tied head once, as HF saves it
    # One process, the same update on the same (concatenated) batch, on the plain model.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    input_ids = torch.cat([torch.arange(10, 30).view(2, 10), torch.arange(15, 35).view(2, 10)])
    reference(input_ids=input_ids).logits.square().mean().backward()
    optimizer.step()
    for rank in (0, 1):
        pushed = torch.load(tmp_path / f"sampler-{rank}.pt")
        assert torch.equal(pushed["lm_head.weight"], pushed["model.embed_tokens.weight"])
        for name, tensor in reference.state_dict().items():
            assert torch.equal(pushed[name], gathered[name.replace("lm_head", "model.embed_tokens")]), name
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


CRITIC_SCRIPT = """
import sys, warnings, torch, torch.distributed as dist
from nanoagent.models import critic_values, load_critic
from nanoagent.parallel import shard_model
dist.init_process_group("gloo")
rank = dist.get_rank()
critic = load_critic("tiny").train()
torch.nn.init.normal_(critic.score.weight, std=0.1, generator=torch.Generator().manual_seed(0))  # not 0: grads flow
critic = shard_model(critic, torch.device("cpu"))
input_ids = torch.load(sys.argv[1] + "/input_ids.pt")[2 * rank:2 * rank + 2]  # this rank's half of the batch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for prompt_lengths in (None, torch.tensor([5, 5])):  # a plain pass, and a shared prompt
        values = critic_values(critic, input_ids, torch.ones_like(input_ids), prompt_lengths)
        values[:, 4:].square().sum().backward()  # summed over ranks by FSDP
grads = {name: parameter.grad.full_tensor() for name, parameter in critic.named_parameters()}
if rank == 0:
    torch.save({"grads": grads, "warnings": [str(warning.message) for warning in caught]}, sys.argv[1] + "/out.pt")
dist.destroy_process_group()
"""


def test_sharded_critic_has_the_unsharded_gradients_and_returns_no_view(tmp_path):
    # FSDP2 hooks the backward pass onto the root's output; a view output invites an in-place op that would drop
    # the hook (and FSDP2 warns). critic_values returns none, and its gradients equal one process's.
    input_ids = torch.randint(10, 800, (4, 12), generator=torch.Generator().manual_seed(0))
    input_ids[1, :5], input_ids[3, :5] = input_ids[0, :5], input_ids[2, :5]  # rows share their prompt in pairs
    torch.save(input_ids, tmp_path / "input_ids.pt")
    script = tmp_path / "critic.py"
    script.write_text(CRITIC_SCRIPT)
    torchrun([str(script), str(tmp_path)])
    sharded = torch.load(tmp_path / "out.pt")
    assert not [message for message in sharded["warnings"] if "view" in message], sharded["warnings"]
    critic = load_critic("tiny").train()
    torch.nn.init.normal_(critic.score.weight, std=0.1, generator=torch.Generator().manual_seed(0))
    for prompt_lengths in (None, torch.tensor([5, 5, 5, 5])):
        values = train.critic_values(critic, input_ids, torch.ones_like(input_ids), prompt_lengths)
        values[:, 4:].square().sum().backward()
    for name, parameter in critic.named_parameters():
        largest = parameter.grad.abs().max()  # float32 sums in another order: equal to 1e-6 of the largest entry
        assert largest > 0 and (sharded["grads"][name] - parameter.grad).abs().max() <= 1e-6 * largest, name



LOAD_SCRIPT = """
import sys, torch, torch.distributed as dist
from nanoagent.models import load_critic, load_model
from nanoagent.parallel import full_weights, shard_model
dist.init_process_group("gloo")
meta, cpu = torch.device("meta"), torch.device("cpu")
policy = shard_model(load_model(sys.argv[1], device=meta)[0], cpu)  # as train.py builds what it shards
critic = shard_model(load_critic(sys.argv[1], device=meta), cpu)
loaded = {"policy": dict(full_weights(policy)), "critic": dict(full_weights(critic)),
          "buffers": dict(policy.named_buffers()), "eos": policy.generation_config.eos_token_id,
          "tied": policy.lm_head.weight is policy.model.embed_tokens.weight}
if dist.get_rank() == 1:  # the rank that read nothing
    torch.save(loaded, sys.argv[2])
dist.barrier()  # rank 0 left first while rank 1 saved: gloo aborted it at exit about once in six runs
dist.destroy_process_group()
"""


def test_models_built_on_the_meta_device_get_the_checkpoints_weights_on_every_rank(tmp_path):
    # Rank 0 reads the checkpoint (stored in bf16, as Qwen2.5 is) and sends each rank its float32 shards: gathered
    # back, they are the weights one process loads, the critic's new head at zero, RoPE's buffers and the tie kept.
    model, tokenizer = load_model("tiny")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tokenizer.save_pretrained(tmp_path / "bf16")
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    torchrun([str(script), str(tmp_path / "bf16"), str(tmp_path / "loaded.pt")])
    loaded = torch.load(tmp_path / "loaded.pt")
    policy, critic = load_model(tmp_path / "bf16")[0], load_critic(tmp_path / "bf16")
    assert loaded["tied"] and loaded["eos"] == policy.generation_config.eos_token_id
    for part, reference in (("policy", policy.state_dict()), ("critic", critic.state_dict()),
                            ("buffers", dict(policy.named_buffers()))):
        assert loaded[part].keys() == reference.keys(), part
        for name, tensor in reference.items():
            assert loaded[part][name].dtype == tensor.dtype and torch.equal(loaded[part][name], tensor), name
    assert not critic.score.weight.any()

# Qwen2.5-0.5B-Instruct's config with 2 of its 24 layers: the real vocabulary (the LM head is most of a step's
# work at this size), heads, tied embedding, bf16 storage, sampling defaults, tokenizer and chat template.
QWEN25_05B_FEW_LAYERS = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                             eos_token_id=151645, dtype="bfloat16")

REHEARSAL_SCRIPT = """
import dataclasses, sys
import envs, train

class ParityEnv(envs.BanditEnv):
    '''The bandit's prompt, scored by the parity of the reply's length: an untrained model's group members score
    differently (it never writes <answer>, so the bandit would score them all -0.1 and GRPO's advantages be 0).'''
    def step(self, text):
        return dataclasses.replace(super().step(text), reward=float(len(text) % 2))

envs.ENVS["parity"] = ParityEnv
train.main(sys.argv[1:])
"""


def qwen25_few_layers():
    """The model above with random weights, saved in bf16 as Qwen2.5 ships (cached)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from nanoagent.checkpoint import save_atomically
    from nanoagent.models import cache_dir
    from tests.qwen25_tokenizer import qwen25_tokenizer
    path = cache_dir() / "qwen2.5-0.5b-2-layers"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B_FEW_LAYERS)).to(torch.bfloat16)
        model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                                   repetition_penalty=1.05, eos_token_id=[151645, 151643],
                                                   pad_token_id=151643, bos_token_id=151643)
        tokenizer = qwen25_tokenizer()
        save_atomically(path, lambda directory: [part.save_pretrained(directory) for part in (model, tokenizer)])
    return path


def test_rehearsal_at_qwen25_shapes_grpo_vllm_two_ranks_save(tmp_path):
    # What a GPU user's first run does, on CPU: GRPO whose groups' rewards differ (so the weights move), the vLLM
    # sampler given the changed weights (step 2 samples after step 1's push), 2 ranks, the last step's checkpoint,
    # and the HF export loaded back. (Resume from a bf16 export is test_train.py's: each leg here costs engine starts
    # at a 152k vocabulary, and the suite's time is bounded. A save at every step on 2 ranks is the tiny model's,
    # above: at this shape each checkpoint is 2.7 GB on disk.)
    import_or_skip_outside_ci("vllm")
    script = tmp_path / "rehearsal.py"
    script.write_text(REHEARSAL_SCRIPT)
    torchrun([str(script), "--model", str(qwen25_few_layers()), "--warmup_steps", "0", "--env", "parity",
              "--sampler", "vllm", "--prompts_per_step", "2", "--group_size", "4",
              "--max_turns", "1", "--max_new_tokens", "8", "--max_total_tokens", "128", "--eval_every", "0",
              "--lr", "1e-4", "--out_dir", str(tmp_path / "run"), "--steps", "2"])
    history = metrics(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["group_reward_std"] > 0 and h["grad_norm"] > 0 for h in history), history
    assert all(h["logprob_mismatch"] <= 1e-5 for h in history), [h["logprob_mismatch"] for h in history]
    exported = tmp_path / "run" / "step_000002"
    policy = AutoModelForCausalLM.from_pretrained(exported)
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    assert policy.dtype == torch.bfloat16 and set(stored_tensors(exported)) == set(policy.state_dict()) - {
        "lm_head.weight"}
    start = AutoModelForCausalLM.from_pretrained(qwen25_few_layers())
    assert not torch.equal(policy.model.embed_tokens.weight, start.model.embed_tokens.weight)  # trained


SKEW_SCRIPT = """
import datetime, json, sys
import torch, torch.distributed as dist
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer
import train
from nanoagent.models import resolve_model_path
from nanoagent.sampler import Generation, TorchSampler, per_row

out, repo, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# One process group for all the runs (gloo's connections made again in one process can meet stale addresses),
# whose collectives time out in seconds: a divergence fails fast, whatever compute_init holds.
init_process_group = dist.init_process_group
dist.init_process_group = lambda *args, **kwargs: dist.is_initialized() or init_process_group(
    *args, **{**kwargs, "timeout": datetime.timedelta(seconds=30)})
train.compute_cleanup = lambda: None


class Collectives(TorchDispatchMode):
    '''Logs every collective this process makes, whoever calls it (dist's functions, FSDP2's all-gathers and
    reduce-scatters, DTensor's functional collectives all reach the dispatcher as c10d ops), with the shapes of
    its tensors (but a gather's or scatter's) and the innermost line of the project that led to it. Flushed at
    once: a hung rank's log stays.'''
    def __init__(self, path):
        super().__init__()
        self.log = open(path, "w", buffering=1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            frame = sys._getframe()
            while frame is not None and not (frame.f_code.co_filename.startswith(repo)
                                             and "site-packages" not in frame.f_code.co_filename):
                frame = frame.f_back  # (a virtual environment inside the checkout is not the project)
            code = frame.f_code if frame else None
            where = f"{code.co_filename[len(repo) + 1:]}:{frame.f_lineno} {code.co_name}" if code else "?"
            rooted = func._opname in ("gather_", "scatter_")  # the root passes more tensors than the others
            shapes = [list(leaf.shape) for leaf in tree_leaves((args, kwargs))
                      if isinstance(leaf, torch.Tensor) and not rooted]
            self.log.write(f"{func} {shapes} {where}\\n")
        return func(*args, **(kwargs or {}))


class Skewed(TorchSampler):
    '''Scripted turns, by rank: rank 0's episodes run on for several long turns (filler up to the token budget, a
    format error), or answer at once, by each row's seed; rank 1's all answer at once. So rank 0's rows are long
    and short, many-turned and one-turned, and rank 1's all short.'''
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=0):
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
        answer, filler = tokenizer.encode("<answer>no</answer><|im_end|>"), tokenizer.encode(" the")[:1]
        return [Generation(filler * budget, [-1.0] * budget, "length") if dist.get_rank() == 0 and row_seed % 3
                else Generation(answer, [-1.0] * len(answer), "stop")
                for budget, row_seed in zip(per_row(max_new_tokens, len(prompts)), per_row(seed, len(prompts)))]


train.TorchSampler = Skewed
recorder = Collectives(f"{out}/collectives-{int(__import__('os').environ['RANK'])}.log")
for argv in runs:
    recorder.log.write(f"run {argv}\\n")
    with recorder:
        train.main(argv)
dist.destroy_process_group()
"""
# Rows on the two ranks differ in length, turns and prompts; each run a step's options: GRPO with groups cut
# between the ranks (3 of 4 groups of 3 kept: 4 rows and 5), PPO with a critic, a KL reference, scoring passes,
# minibatches, TIS and an eval, LoRA, shared prompts off (REINFORCE++ on every token), and a resume.
SKEWED = ["--env", "synthetic_qa", "--warmup_steps", "0", "--max_turns", "3", "--max_new_tokens", "12",
          "--max_total_tokens", "256", "--prompts_per_step", "4", "--group_size", "3", "--eval_every", "0",
          "--save_every", "1", "--device", "cpu"]
SKEWED_RUNS = [["--algo", "grpo", "--filter_ratio", "0.75"],
               ["--algo", "ppo", "--kl", "loss", "--minibatch_size", "4", "--ppo_epochs", "2", "--tis_cap", "2",
                "--eval_every", "2", "--eval_episodes", "3"],
               ["--algo", "grpo", "--lora_rank", "4"],
               ["--algo", "reinforce_pp", "--no_action_mask"],
               ["--algo", "gigpo", "--env", "sokoban"]]  # per-turn rewards, anchor groups across ranks


def test_ranks_given_skewed_work_make_the_same_collectives_in_the_same_order(tmp_path):
    # Every forward of a sharded model is a collective: a rank that runs another number of them than the others
    # waits forever (shared_prompt_hidden's passes of similar length once did, on rows like these).
    runs = [SKEWED + flags + ["--out_dir", str(tmp_path / str(index)), "--steps", "2"]
            for index, flags in enumerate(SKEWED_RUNS)]
    runs.append(runs[0][:-1] + ["3", "--resume"])
    script = tmp_path / "skewed.py"
    script.write_text(SKEW_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), str(tmp_path), str(REPO), json.dumps(runs)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    logs = [(tmp_path / f"collectives-{rank}.log").read_text().splitlines() for rank in (0, 1)]
    for index, (zero, one) in enumerate(itertools.zip_longest(*logs)):
        assert zero == one, (f"collective {index}: rank 0 made {zero}, rank 1 {one} (None: it stopped; the last "
                             f"shared: {logs[0][index - 1]})\n{result.stderr[-3000:]}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert [line for line in logs[0] if line.startswith("run")] == [f"run {argv}" for argv in runs]
    assert any("nanoagent/models.py" in line for line in logs[0]), "FSDP2's all-gathers were not recorded"
