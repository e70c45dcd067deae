"""
Benchmark: nanoagent's training step on this machine, with a FLOP cost model (CPU or GPU).

Runs `train.py` (GRPO by default, any train.py flags pass through) for a few steps after its cached
warm-up and reports seconds per step, tokens per second, peak memory, and achieved FLOP/s against a
matmul ceiling measured on the same device, in the model's dtype. On a GPU it also reports MFU, the
share of the card's datasheet bf16 peak (known cards below, or --peak_tflops):

    python bench/bench_train.py                      # tiny model, synthetic QA, 20 GRPO steps
    python bench/bench_train.py --algo ppo --steps 40  # + the critic's forward and backward
    python bench/bench_train.py --device cuda --model DIR --warmup_steps 0 --peak_tflops 989
    python bench/bench_train.py --profile --warmup_profile_steps 100  # where a step's and the warm-up's time goes

--profile times the functions that each numbered step of train.main calls (perf_counter around each call, a
few microseconds against milliseconds), over the timed steps, and prints a table: each part's milliseconds
per step and share of the steps' wall time, what a part calls indented below it with the rest of its time,
and what no timed function covers as "other". --warmup_profile_steps N runs a fresh warm-up (sft.warm_up, N
SFT steps in each of its two phases, in a temporary cache) and prints its table likewise.

Cost model, per step. T = tokens of all trajectories of the step, K = the agent's tokens among them
(the ones the loss reads), N_body = parameters of the transformer body, N_head = the LM head's.
T_p = T less the prompt tokens that the G members of a group share: the policy runs each group's
prompt once (train.shared_prompt_hidden). A policy forward pass costs F = 2 N_body T_p + 2 N_head K:
train.py sends only the loss's positions through the LM head (nanoagent/models.py: token_logprobs). A backward
pass costs 2F.
  policy:  3F per update pass (forward + backward), per PPO epoch; + F for the old log-probs, unless
           the step is a single update, which reuses its own forward (train.py, step 3)
  critic:  PPO only, 2 N_body T_p (values) + 6 N_body T_p per epoch (its head has one output)
  rollout: not counted; it is mostly small decode steps, bound by memory and Python, not by FLOPs.
With --filter_ratio < 1 the update sees only the kept groups: the count is scaled by their share.
Attention's T^2 term is left out: at these lengths (about 150 tokens) it is a few percent of 2 N_body.
"""

import argparse
import contextlib
import functools
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the concept files live at the repository root
import envs  # noqa: E402
import masks  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
import tools  # noqa: E402
import train  # noqa: E402
from nanoagent.common import autodetect_dtype  # noqa: E402
from nanoagent.sampler import TorchSampler, VLLMSampler  # noqa: E402

# Dense bf16 tensor-core peaks from the vendor's datasheets (SXM parts), in FLOP/s.
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def matmul_ceiling(device, dtype, size, repeats=50):
    """FLOP/s of a square matmul in `dtype` on `device`: the ceiling the training step is measured against."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(5):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def peak_memory_mb():
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


TIMED_FROM = 2  # the first two steps pay for one-time start-up work: steps 3..N are timed


def timed_run(train_argv, steps):
    """train.main for `steps` steps with these train.py flags, in a temporary out_dir, with no evaluation
    and no checkpoint before the end. Returns (args, policy, history, seconds per step, trajectory tokens
    per step), timed over steps 3..N."""
    with tempfile.TemporaryDirectory() as out_dir:
        argv = [*train_argv, "--steps", str(steps), "--eval_every", "0", "--save_every", str(steps),
                "--out_dir", out_dir]  # last: these win over a recipe's own
        args = train.get_args(argv)
        policy, history = train.main(argv)
    measured = history[TIMED_FROM:]
    seconds = (measured[-1]["elapsed_s"] - history[TIMED_FROM - 1]["elapsed_s"]) / len(measured)
    tokens = statistics.fmean(h["trajectory_tokens"] for h in measured) * args.prompts_per_step * args.group_size
    return args, policy, history, seconds, tokens


# -----------------------------------------------------------------------------
# --profile and --warmup_profile_steps: where the time goes


def new_profile():
    """Seconds and calls per part, a part named by its path: the labels of the timed calls it runs inside."""
    return {"seconds": {}, "calls": {}, "stack": [], "starts": [], "episodes": {}, "rollouts": 0, "turn": 0,
            "start": None, "end": None}


def synchronize():
    """Wait for the GPU's queued work, so that it counts in the part that queued it (nothing to wait for on CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def begin(profile, name):
    """Start timing a part named `name` inside the parts running now."""
    profile["stack"].append(name)
    profile["seconds"].setdefault(tuple(profile["stack"]), 0.0)  # first seen, first listed: a part before its own
    synchronize()
    profile["starts"].append(time.perf_counter())


def end(profile):
    """Stop timing the innermost running part."""
    synchronize()
    now, path = time.perf_counter(), tuple(profile["stack"])
    profile["seconds"][path] += now - profile["starts"].pop()
    profile["calls"][path] = profile["calls"].get(path, 0) + 1
    profile["stack"].pop()
    if not profile["stack"]:
        profile["end"] = now  # the steps' clock stops when the last step's last timed part ends


def timed(profile, function, label):
    """`function`, each call timed under the name label(*args, **kwargs) gives (None: untimed, its caller's time)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        name = label(*args, **kwargs)
        if name is None:
            return function(*args, **kwargs)
        begin(profile, name)
        try:
            return function(*args, **kwargs)
        finally:
            end(profile)
    return wrapper


@contextlib.contextmanager
def profiling(profile, parts):
    """Replace each (owner, attribute, label) of `parts` with its timed version, and time every backward pass
    and optimizer step, named by the loss computed last (profile["backward"], profile["optimizer"])."""
    with contextlib.ExitStack() as patches:
        for owner, attribute, label in parts:
            patches.enter_context(mock.patch.object(owner, attribute, timed(profile, getattr(owner, attribute), label)))
        patches.enter_context(mock.patch.object(torch.Tensor, "backward", timed(
            profile, torch.Tensor.backward, lambda *args, **kwargs: profile.get("backward", "backward"))))
        for hook in (register_optimizer_step_pre_hook(lambda *args: begin(profile, profile.get("optimizer", "step"))),
                     register_optimizer_step_post_hook(lambda *args: end(profile))):
            patches.callback(hook.remove)
        yield profile


def new_step(profile):
    """Count a training step; at the first timed one, start the clock and forget what the steps before timed."""
    profile["rollouts"] += 1
    if profile["rollouts"] == TIMED_FROM + 1:
        profile.update(seconds={}, calls={}, episodes={}, start=time.perf_counter())


def new_turn(profile, what, episodes):
    """The label of a step's next generation call, `what`, for `episodes` episodes, which the table averages."""
    profile["turn"] += 1
    name = f"turn {profile['turn']}: {what}"
    path = (*profile["stack"], name)
    profile["episodes"][path] = profile["episodes"].get(path, 0) + episodes
    return name


def timer_cost(repeats=20_000):
    """Seconds that timing one call adds (its label, clock reads and bookkeeping), on a call that does nothing."""
    profile = new_profile()
    nothing = timed(profile, lambda: None, lambda: "nothing")
    start = time.perf_counter()
    for _ in range(repeats):
        nothing()
    return (time.perf_counter() - start) / repeats


def step_parts(profile):
    """(owner, attribute, label) of the functions train.main's step calls, named after its numbered steps.
    Replacing the attribute intercepts every call: train.py calls `rollout.rollout` and `masks.collate`
    through their modules and its own helpers by bare name, looked up in train's globals at call time
    (rollout.py likewise its encode_chat and observation_tokens, envs.py its step_envs)."""
    def top(name):  # a part train.main calls itself; called from inside a timed part, it is that part's time
        return lambda *args, **kwargs: None if profile["stack"] else name

    def nested(name):
        return lambda *args, **kwargs: name

    def training_rollout(*args, **kwargs):
        profile["turn"] = 0
        if profile["stack"]:
            return "rollout.rollout"  # the held-out evaluation's
        new_step(profile)
        return "1. rollout (rollout.rollout)"

    def generate(sampler, prompts, *args, **kwargs):  # one call a turn, every running episode in it
        return new_turn(profile, "sampler.generate", len(prompts))

    def scoring(model, *args, **kwargs):  # the update's forward runs with gradients, the scoring passes without
        if profile["stack"]:
            return None  # inside the RAGEN-2 probe
        if torch.is_grad_enabled():
            return "5. update: policy forward (token_logprobs)"
        # set_up puts the policy in train mode; the reference stays in the eval mode load_model gives it
        return f"3. score: {'old' if model.training else 'reference'} log-probs (token_logprobs)"

    def critic_forward(*args, **kwargs):  # the scoring pass without gradients, the update's with them
        if profile["stack"]:
            return None
        if torch.is_grad_enabled():
            return "5. update: critic forward (critic_values)"
        return "3. score: critic values (critic_values)"

    def loss(which, name):  # a loss names the backward pass and the optimizer step that follow it
        def label(*args, **kwargs):
            profile.update(backward=f"5. update: {which} backward", optimizer=f"5. update: {which} optimizer step")
            return name
        return label

    credit = top("4. credit (masks)")
    return [
        (rollout, "rollout", training_rollout),
        (rollout, "encode_chat", nested("encode prompts (rollout.encode_chat)")),
        (TorchSampler, "generate", generate), (VLLMSampler, "generate", generate),
        (envs, "step_envs", nested("env.step (envs.step_envs)")),
        (tools, "run_tool_calls", nested("tools (tools.run_tool_calls)")),
        (rollout, "observation_tokens", nested("encode observations (rollout.observation_tokens)")),
        (train, "keep_high_variance_groups", top("2. filter (keep_high_variance_groups)")),
        (masks, "collate", top("2. collate (masks.collate)")),
        (train, "token_logprobs", scoring),
        (train, "critic_values", critic_forward),
        (train, "cross_prompt_logprobs", top("3. score: RAGEN-2 probe (cross_prompt_logprobs)")),
        *[(masks, name, credit) for name in ("compute_gae", "grpo_advantages", "reinforce_pp_advantages",
                                               "masked_whiten", "explained_variance")],
        (masks, "value_loss", loss("critic", "5. update: critic loss (masks.value_loss)")),
        (masks, "policy_loss", loss("policy", "5. update: policy loss (masks.policy_loss)")),
        (train, "clip_gradients", top("5. update: clip gradients (clip_gradients)")),
        (TorchSampler, "update_weights", top("6. sync (sampler.update_weights)")),
        (VLLMSampler, "update_weights", top("6. sync (sampler.update_weights)")),
        (train, "end_of_step", top("7. end_of_step")),
        (rollout, "summarize", nested("metrics (rollout.summarize)")),
        (train, "kept_group", nested("trajectories kept (kept_group)")),
        (train, "append_jsonl", nested("write metrics and trajectories (append_jsonl)")),
        (train, "evaluate_held_out", nested("held-out eval (eval.evaluate_held_out)")),
        (train, "save_checkpoint", nested("checkpoint: CPU copies, written in the background (save_checkpoint)")),
        (train, "finish_checkpoint", lambda *args, **kwargs: "wait for the previous checkpoint (finish_checkpoint)"
         if profile["stack"] else "end of run: wait for the last checkpoint's write (finish_checkpoint)"),
    ]


def warm_up_parts(profile):
    """(owner, attribute, label) of the functions sft.warm_up calls (by bare name, in sft's globals)."""
    def forward(*args, **kwargs):
        profile.update(backward="backward", optimizer="optimizer step (AdamW)")
        return "forward (sft.demonstration_loss)"
    return [
        (sft, "load_model", lambda *args, **kwargs: "load the model (load_model)"),
        (sft, "demonstrations", lambda *args, **kwargs: "build demonstrations (sft.demonstrations)"),
        (envs, "step_envs", lambda *args, **kwargs: "env.step (envs.step_envs)"),
        (rollout, "encode_chat", lambda *args, **kwargs: "encode (rollout.encode_chat)"),
        (sft, "assistant_token_mask", lambda *args, **kwargs: "action mask (assistant_token_mask)"),
        (sft, "demonstration_loss", forward),
        (torch.nn.utils, "clip_grad_norm_", lambda *args, **kwargs: "clip gradients (clip_grad_norm_)"),
        (sft, "save_atomically", lambda *args, **kwargs: "save (save_atomically)"),
    ]


def profile_table(profile, total, per=1, scale=1.0):
    """[(depth, name, value, calls, share of total)]: a part, then what it calls, indented, with the rest
    of its time; the top level's rest is "other". value = seconds * scale / per, calls / per."""
    table = []

    def add(parent, seconds):
        children = [path for path in profile["seconds"] if path[:-1] == parent]
        for path in children:
            name = path[-1]
            if path in profile["episodes"]:
                name += f" ({profile['episodes'][path] / profile['calls'][path]:.1f} episodes)"
            table.append((len(parent), name, profile["seconds"][path] * scale / per, profile["calls"][path] / per,
                          profile["seconds"][path] / total))
            add(path, profile["seconds"][path])
        if children:
            rest = seconds - sum(profile["seconds"][path] for path in children)
            table.append((len(parent), "rest" if parent else "other", rest * scale / per, None, rest / total))
    add((), total)
    return table


def print_table(table, value_header, calls_header):
    print(f"| part | {value_header} | {calls_header} | share |\n| --- | ---: | ---: | ---: |")
    for depth, name, value, calls, share in table:
        calls = "" if calls is None else f"{calls:.2f}".rstrip("0").rstrip(".")  # 64, 83.5, 0.17
        print(f"| {'· ' * depth}{name} | {value:.1f} | {calls} | {share:.1%} |")


def profile_warm_up(args, steps, device):
    """A fresh warm-up with this run's flags, `steps` SFT steps in each phase, profiled in a temporary cache
    (the tiny model itself comes from the real one). Returns (profile, seconds)."""
    profile, model = new_profile(), train.resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as cache, mock.patch.object(sft, "cache_dir", lambda: Path(cache)), \
            profiling(profile, warm_up_parts(profile)):
        start = time.perf_counter()
        sft.warm_up(model, args.env, args.env_options, clean_steps=steps, steps=steps, lr=args.warmup_lr,
                    batch_size=args.warmup_batch_size, mistake_rate=args.warmup_mistake_rate,
                    world_model=args.warmup_world_model, seed=args.seed, device=device)
        return profile, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps", type=int, default=20, help="training steps (at least 3: two are not timed)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak (default: known cards)")
    parser.add_argument("--profile", action="store_true", help="print where the timed steps' time goes")
    parser.add_argument("--warmup_profile_steps", type=int, default=0,
                        help="then profile a fresh warm-up of this many SFT steps a phase (0: none)")
    own, train_argv = parser.parse_known_args()
    if own.steps < 3:
        parser.error("--steps must be at least 3: the first two steps are not timed")
    profile = new_profile()
    with profiling(profile, step_parts(profile)) if own.profile else contextlib.nullcontext():
        args, policy, history, seconds, tokens = timed_run(train_argv, own.steps)
    parameter = next(policy.parameters())
    embedding, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    total = sum(p.numel() for p in policy.parameters())
    body = total - embedding.numel() - (0 if head is embedding else head.numel())  # a lookup costs no FLOPs
    episodes, measured = args.prompts_per_step * args.group_size, history[TIMED_FROM:]
    agent_tokens = statistics.fmean(h["response_tokens"] for h in measured) * episodes  # K, per step (T: tokens)
    shared_prompts = statistics.fmean(h["prompt_tokens"] for h in measured) * (episodes - args.prompts_per_step)
    if args.no_action_mask:  # the loss reads every position: nothing is shared, every position goes through the head
        body_tokens, head_tokens = tokens, tokens
    else:
        body_tokens, head_tokens = tokens - shared_prompts, agent_tokens  # T_p, K
    forward = 2 * body * body_tokens + 2 * head.numel() * head_tokens
    kept = statistics.fmean(h["kept_trajectories"] for h in measured)  # StarPO-S filtering may drop groups
    single_update = train.is_single_update(args, round(kept), args.steps - 1)  # no separate old-log-prob pass
    flops = (3 * args.ppo_epochs + (0 if single_update else 1) + (1 if args.kl != "none" else 0)) * forward
    if args.algo == "ppo":
        flops += (2 + 6 * args.ppo_epochs) * body * body_tokens
    flops *= kept / episodes  # the update trains on the kept trajectories only (taken to be of average length)
    dtype = autodetect_dtype(parameter.device.type)  # what the matmuls run in (the stored master weights are float32)
    ceiling = matmul_ceiling(parameter.device, dtype, 8192 if parameter.device.type == "cuda" else 1024)
    achieved = flops / seconds
    peak_mb = peak_memory_mb()
    print(f"model {args.model} ({total / 1e6:.2f}M parameters), {args.algo}, {episodes} episodes/step, "
          f"{torch.get_num_threads()} threads, device {parameter.device}, {dtype}")
    print(f"seconds/step {seconds:.2f} | tokens/step {tokens:.0f} | tokens/s {tokens / seconds:.0f} | "
          f"peak memory {peak_mb:.0f} MB (process RSS)")
    print(f"training FLOP/step {flops / 1e9:.2f} G | achieved {achieved / 1e9:.2f} GFLOP/s | "
          f"matmul ceiling {ceiling / 1e9:.1f} GFLOP/s | {100 * achieved / ceiling:.1f}% of it "
          "(the step's time includes the rollout, which the FLOP count leaves out)")
    if parameter.device.type == "cuda":
        name = torch.cuda.get_device_name(parameter.device)
        peak = own.peak_tflops * 1e12 if own.peak_tflops else next(
            (value for key, value in BF16_PEAK.items() if key in name), None)
        print(f"GPU {name}: peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB | " + (
            f"MFU {100 * achieved / peak:.2f}% of its {peak / 1e12:.0f} TFLOP/s bf16 peak" if peak
            else "bf16 peak unknown: pass --peak_tflops for MFU"))
    if own.profile:
        timed_steps, total = own.steps - TIMED_FROM, profile["end"] - profile["start"]
        print(f"\nwhere a step's time goes: steps {TIMED_FROM + 1}..{own.steps}, {1000 * total / timed_steps:.0f} ms a "
              "step by the profile's clock (from the first timed rollout to the last step's end)")
        print_table(profile_table(profile, total, timed_steps, 1000), "ms/step", "calls/step")
        calls, cost = sum(profile["calls"].values()) / timed_steps, timer_cost()
        print(f"the timers' own cost: {calls:.0f} timed calls a step x {1e6 * cost:.1f} us = "
              f"{1000 * calls * cost:.2f} ms, {calls * cost * timed_steps / total:.2%} of the step")
    if own.warmup_profile_steps:
        profile, total = profile_warm_up(args, own.warmup_profile_steps, parameter.device)
        demonstrations = profile["seconds"][("build demonstrations (sft.demonstrations)",)]
        sft_steps = 2 * own.warmup_profile_steps
        print(f"\nwhere the warm-up's time goes: {sft_steps} SFT steps ({own.warmup_profile_steps} a phase) in "
              f"{total:.1f} s: {1000 * (total - demonstrations) / sft_steps:.0f} ms a step besides building the "
              f"demonstrations ({demonstrations:.1f} s, once a phase)")
        print_table(profile_table(profile, total), "seconds", "calls")


if __name__ == "__main__":
    main()
