"""
GPU check: what CI's CPU machines cannot show. Run it from the repository root on a machine with a
CUDA GPU, after the README's GPU set-up (`pip install -r requirements-gpu.txt`: vLLM and pytest; on a node
without vLLM, `pip install -r requirements-dev.txt` is enough):

    python bench/gpu_check.py
    python bench/gpu_check.py --peak_tflops 362      # a card bench_train.py does not know (here an L40S)

1. the GPU-marked tests (tests/test_gpu.py): the samplers' log-probs against the trainer's on the
   GPU, a short bf16 training run, and the VLLMSampler with its weight sync when vLLM is installed;
2. 20 GRPO steps on CUDA in bf16 with the TorchSampler (bench/bench_train.py): step time, tokens/s,
   achieved FLOP/s and MFU against the card's bf16 peak;
3. the same with the VLLMSampler, when vLLM is installed, then 3 steps with the engine asleep during
   each update (--vllm_sleep: the weight push wakes it); then 3 with LoRA adapters (--lora_rank 16, with
   vLLM when installed: sharded with their layers, the merged weights pushed; its FLOP count is full
   fine-tuning's, which LoRA's frozen weights do not all spend);
4. the samplers' tokens/s on the GPU (bench/bench_sampler.py): TorchSampler, model.generate, and
   VLLMSampler when vLLM is installed;
5. the FSDP2 bf16-mixed path on its own: PPO with a critic and a KL reference, activation checkpointing,
   checkpoints at steps 1 and 2 (the second refills the first's pinned staging buffers) and a resume to
   step 3 (sharded optimizer state and fp32 masters), FSDP2's warning of a view returned by a sharded root
   made an error, then the HF checkpoint loaded with AutoModelForCausalLM: tie restored, the head stored
   once, the sampling train.py used in generation_config.json. Every GPU run takes this path (a single GPU
   is a 1-rank FSDP2 group).
It ends with one table: each of the above, passed or failed (a failure does not stop the rest).
The model has Qwen2.5-0.5B's shape (24 layers, width 896) with random weights and the tiny model's
tokenizer, built here, so nothing is downloaded; it skips the warm-up, so it fails the tasks, and its
turns run to their token limit: this measures speed, not learning.
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from nanoagent.models import tiny_model, tiny_tokenizer  # noqa: E402

QWEN25_05B_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        intermediate_size=4864)


VERIFIED = []  # (what a command verifies, whether it passed): the table printed at the end


def run(what, command):
    """Run a command, showing it and its output, and record whether it verified `what`; a failure does not
    stop the check, so that the table says everything a lent GPU could show."""
    print(f"\n# {what}\n$ " + " ".join(command), flush=True)
    VERIFIED.append((what, subprocess.run(command).returncode == 0))


def main():
    parser = argparse.ArgumentParser(description="GPU tests and a bf16 training benchmark with MFU")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU; on CPU, run the test suite and bench/bench_train.py instead")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}")
    run("GPU tests: samplers' log-probs vs the trainer's, bf16 training, vLLM weight sync",
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"])
    with tempfile.TemporaryDirectory() as model_dir:
        tokenizer = tiny_tokenizer()
        tiny_model(tokenizer, **QWEN25_05B_SHAPE).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        bench = [sys.executable, "bench/bench_train.py", "--device", "cuda", "--model", model_dir,
                 "--warmup_steps", "0", *(["--peak_tflops", str(cli.peak_tflops)] if cli.peak_tflops else [])]
        run("0.5B shape, bf16 GRPO, TorchSampler: step time and MFU", bench)
        has_vllm = importlib.util.find_spec("vllm") is not None
        if has_vllm:
            run("0.5B shape, bf16 GRPO, VLLMSampler: step time and MFU", bench + ["--sampler", "vllm"])
            run("--vllm_sleep: the engine asleep during the update", bench + ["--sampler", "vllm", "--vllm_sleep",
                                                                             "--steps", "3"])
        else:
            print("\nvLLM is not installed: the VLLMSampler runs are skipped (pip install -r requirements-gpu.txt)")
        run("--lora_rank 16: adapters sharded, the merged weights pushed to the sampler",
            bench + ["--sampler", "vllm" if has_vllm else "torch", "--lora_rank", "16", "--steps", "3"])
    run("samplers' tokens/s", [sys.executable, "bench/bench_sampler.py", "--device", "cuda"])
    with tempfile.TemporaryDirectory() as out_dir:
        fsdp = [sys.executable, "-W", "error:FSDP2-wrapped module:UserWarning", "train.py", "--device", "cuda",
                "--warmup_steps", "0", "--algo", "ppo", "--kl", "loss", "--activation_checkpointing", "--eval_every",
                "0", "--save_every", "1", "--out_dir", out_dir]  # step 2's save refills step 1's pinned buffers
        run("FSDP2 bf16 PPO + KL + activation checkpointing, no view warning", fsdp + ["--steps", "2"])
        run("resume: sharded optimizer state and fp32 masters", fsdp + ["--steps", "3", "--resume"])
        load_and_check_the_tie = (
            "import sys, transformers, safetensors.torch; model = transformers.AutoModelForCausalLM.from_pretrained("
            "sys.argv[1]); assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(); "
            "assert 'lm_head.weight' not in safetensors.torch.load_file(sys.argv[1] + '/model.safetensors'); "
            "assert (model.generation_config.temperature, model.generation_config.top_p) == (1.0, 1.0); "
            "print('HF checkpoint loads, tie restored, head stored once, sampling as trained')")
        run("HF export: tie, head stored once, generation_config", [sys.executable, "-c", load_and_check_the_tie,
                                                                     f"{out_dir}/step_000003"])
    print("\n| what gpu_check verified | result |\n| --- | --- |")
    for what, passed in VERIFIED:
        print(f"| {what} | {'passed' if passed else 'FAILED'} |")
    sys.exit(0 if all(passed for _, passed in VERIFIED) else 1)


if __name__ == "__main__":
    main()
