"""
Qwen2.5-3B and -7B shapes on one GPU (docs/gpu.md): a run's peak memory, speed and checkpoints beside the
memory planner's numbers. From the repository root, on a machine with a CUDA GPU:

    python bench/gpu_shapes.py --tokenizer DIR --work DIR            # 3B full fine-tuning, 7B with LoRA
    python bench/gpu_shapes.py --tokenizer DIR --work DIR --toy --device cpu --prompts_per_step 2 \
        --group_size 2                                               # the same steps at toy sizes

DIR for --tokenizer holds the real Qwen2.5 tokenizer: `tests/qwen25_tokenizer.py` rebuilds it offline
(`qwen25_tokenizer().save_pretrained(DIR)`), so nothing is downloaded. For each shape:
1. Qwen2.5's published config (bench/memory_plan.py's table: the real vocabulary, tied or not), random
   weights built on the device in bf16 and saved as Qwen2.5 ships;
2. bench/bench_train.py for 3 GRPO steps on the default env: TorchSampler, bf16 compute with float32 masters
   (the 1-rank FSDP2 group every GPU run takes), --activation_checkpointing, 7B with --lora_rank 16; the last
   step checkpointed. It prints the step time, tokens/s, MFU and the peak GPU memory;
3. train.py --resume for a 4th step and its checkpoint, then the export checked without loading its weights:
   every tensor the model has, stored once, in bf16 (LoRA: the merged model, and adapter/ beside it).
docs/gpu.md sets the peaks beside bench/memory_plan.py's for the same runs (one GPU, no vLLM, these tokens).
A checkpoint holds 12-16 bytes a parameter (masters and AdamW's moments; LoRA's frozen base in float32), ~45 GB
at 3B and 7B: the model's own directory (--models puts it elsewhere, e.g. in memory) and the first checkpoint are
deleted once no step needs them, so one checkpoint at a time sits on the disk, and each shape starts by deleting
what a run cut short left. Random weights fail the task and their turns run to the token limit: this measures
memory and speed, not learning.
"""

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from memory_plan import QWEN25  # noqa: E402

SHAPES = {"3b": ("Qwen/Qwen2.5-3B-Instruct", []), "7b": ("Qwen/Qwen2.5-7B-Instruct", ["--lora_rank", "16"])}
TOY = (64, 1, 4, 2, 128)  # hidden, layers, heads, kv heads, intermediate: --toy, to try the script on a CPU


def build(name, tokenizer_dir, path, device, toy):
    """Qwen2.5's config for `name` with random bf16 weights, and the real tokenizer, saved to path."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = QWEN25[name]
    if toy:
        hidden, layers, heads, kv_heads, intermediate = TOY
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151645)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


def run(command, log, limit):
    """Run a command, its output kept in `log` and shown after; its exit status (124: cut at `limit` s)."""
    print("$ " + " ".join(command), flush=True)
    with open(log, "w") as out:
        try:
            status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            status = 124
    print(Path(log).read_text(), flush=True)
    return status


def resume(command, out_dir, log, limit):
    """train.py --resume for one more step; once that step is logged the checkpoint it resumed from is
    deleted (its weights are loaded), so its successor fits beside nothing else on the disk."""
    print("$ " + " ".join(command), flush=True)
    start, first = time.time(), sorted(out_dir.glob("step_*"))
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None and time.time() - start < limit:
            time.sleep(1)
            metrics = out_dir / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if first and len(lines) >= 4:
                for path in first:
                    shutil.rmtree(path)
                first = []
        if process.poll() is None:
            process.kill()
    print(Path(log).read_text(), flush=True)
    return process.wait()


def check_export(path, lora):
    """The export holds every tensor of the model once (a tied head not at all), in bf16, without reading the
    weights; with LoRA, adapter/ is there too."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(config).state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    stored, dtypes = set(), set()
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            for key in tensors.keys():
                stored.add(key)
                dtypes.add(str(tensors.get_slice(key).get_dtype()))
    assert stored == expected, (sorted(stored ^ expected)[:5], "stored vs the model's tensors")
    assert dtypes == {"BF16"}, dtypes
    assert not lora or (Path(path) / "adapter" / "adapter_config.json").exists(), "no adapter/"
    size = sum(f.stat().st_size for f in Path(path).parent.rglob("*") if f.is_file()) / 1e9
    print(f"export {path}: {len(stored)} tensors, bf16, each once; the checkpoint {size:.1f} GB", flush=True)


def main():
    parser = argparse.ArgumentParser(description="Qwen2.5-3B/7B shapes on one GPU: memory, speed, checkpoints")
    parser.add_argument("--tokenizer", required=True, help="a directory with the real Qwen2.5 tokenizer")
    parser.add_argument("--work", required=True, help="where models and checkpoints go (~60 GB free)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--toy", action="store_true", help="1 layer, width 64: try the script on a CPU")
    parser.add_argument("--models", default=None, help="where the built models go (default: in --work)")
    parser.add_argument("--logs", default=None, help="where each run's log is kept (default: --work)")
    parser.add_argument("--limit", type=float, default=600,
                        help="seconds each shape's runs may take (on an H200 the checkpoints take most)")
    args, train_flags = parser.parse_known_args()  # the rest go to train.py
    for shape in args.shapes:
        name, extra = SHAPES[shape]
        start, work = time.time(), Path(args.work) / shape
        logs = Path(args.logs or args.work)
        logs.mkdir(parents=True, exist_ok=True)
        model = Path(args.models) / shape if args.models else work / "model"
        out_dir = work / "run"
        shutil.rmtree(work, ignore_errors=True)
        print(f"\n## {name} shape{' (toy)' if args.toy else ''}, {' '.join(extra) or 'full fine-tuning'}",
              flush=True)
        build(name, args.tokenizer, model, args.device, args.toy)
        print(f"built and saved in {time.time() - start:.0f} s", flush=True)
        flags = ["--device", args.device, "--model", str(model), "--warmup_steps", "0",
                 "--activation_checkpointing", *extra, *train_flags]
        status = run([sys.executable, "bench/bench_train.py", "--steps", "3", "--out_dir", str(out_dir), *flags],
                     logs / f"{shape}_bench_train.log", args.limit)
        shutil.rmtree(model)  # the resume reads the checkpoint's export
        if status == 0:
            left = args.limit - (time.time() - start)
            command = [sys.executable, "train.py", "--steps", "4", "--eval_every", "0", "--save_every", "3",
                       "--out_dir", str(out_dir), "--resume", *flags]
            status = resume(command, out_dir, logs / f"{shape}_resume.log", left)
        if status == 0:
            check_export(out_dir / "step_000004", bool(extra))
        print(f"## {name}: exit {status} after {time.time() - start:.0f} s", flush=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
