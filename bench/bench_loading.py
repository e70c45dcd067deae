"""
Peak host memory per rank while train.py's ranks load and shard the policy: at Qwen2.5-0.5B-Instruct's shape
(24 layers, vocabulary 151,936, tied embedding, stored in bf16 as Qwen ships it) with random weights, built here
once (nothing is downloaded), on 2 CPU ranks (gloo):

    python bench/bench_loading.py              # train.py's way: built on the meta device, rank 0 reads the weights
    python bench/bench_loading.py --full_copy  # the old way: every rank loads the whole float32 model, then shards
    python bench/bench_loading.py --nproc 4    # more ranks: each holds a smaller shard

Each rank reports its peak resident memory (ru_maxrss) before loading (Python, torch and transformers) and after
the policy is sharded and filled, and the bytes of its own float32 shards.
"""

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanoagent/ lives at the repository root
from memory_plan import QWEN25  # noqa: E402
from nanoagent.checkpoint import save_atomically  # noqa: E402
from nanoagent.models import cache_dir, load_model, tiny_tokenizer  # noqa: E402
from nanoagent.parallel import shard_model  # noqa: E402


def qwen25_05b_random():
    """Qwen2.5-0.5B-Instruct's config with random weights, saved in bf16 with the tiny tokenizer (cached)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    path = cache_dir() / "qwen2.5-0.5b-random-bf16"
    if not (path / "config.json").exists():
        hidden, layers, heads, kv_heads, intermediate, vocab, tied = QWEN25["Qwen/Qwen2.5-0.5B-Instruct"]
        config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                             tie_word_embeddings=tied, dtype="bfloat16")
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        save_atomically(path, lambda directory: [part.save_pretrained(directory) for part in (model, tiny_tokenizer())])
    return path


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def rank_main(path, full_copy):
    """One rank: load and shard the policy as train.py does; rank 0 prints every rank's numbers."""
    dist.init_process_group("gloo")
    before = peak_mb()
    cpu = torch.device("cpu")
    policy, _ = load_model(path, device=cpu if full_copy else torch.device("meta"))
    policy = shard_model(policy.train(), cpu)
    shard_mb = sum(parameter.to_local().numel() * 4 for parameter in policy.parameters()) / 2 ** 20
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), before, peak_mb(), shard_mb))
    if dist.get_rank() == 0:
        print(f"{'full float32 copy on every rank' if full_copy else 'built on the meta device'}, "
              f"{len(everyone)} ranks:\n| rank | peak before loading (MB) | peak after (MB) | its float32 shards (MB) |"
              "\n|---|---|---|---|")
        for rank, start, end, shards in everyone:
            print(f"| {rank} | {start:.0f} | {end:.0f} | {shards:.0f} |")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="peak host memory per rank while loading a sharded model")
    parser.add_argument("--full_copy", action="store_true", help="every rank loads the whole float32 model (old)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rank_of", default=None, help=argparse.SUPPRESS)  # set when torchrun starts the ranks
    cli = parser.parse_args()
    if cli.rank_of:
        return rank_main(cli.rank_of, cli.full_copy)
    path = qwen25_05b_random()  # built here, so building it counts in no rank's peak
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cli.nproc}",
               __file__, "--rank_of", str(path), *(["--full_copy"] if cli.full_copy else [])]
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    main()
