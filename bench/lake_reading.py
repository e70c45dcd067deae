"""
Probe: what holds the tiny model back on FrozenLake (docs/games.md).

Warms a model up on correct FrozenLake demonstrations alone (sft.warm_up, one phase, no flawed
demonstrations), then reports two things on the held-out maps:
  1. success, eval.py's rows: sampled at temperature 1 (as training evaluates) and greedy;
  2. the first turn's decision on each map, read off the model's next-token distribution after
     `<answer>`: the probability it puts on the moves that start a shortest path, and where its
     likeliest move goes when it is not one of them (into a hole, away from the goal, into the edge),
     by the goal's distance.
Run from the repository root; each line is one probe of the study:

    python bench/lake_reading.py                           # the game's warm-up: tiny, 950 steps, 3,000 levels
    python bench/lake_reading.py --levels 15000            # memorising the levels? five times as many
    python bench/lake_reading.py --batch_size 64 --lr 2e-3 # four times the compute
    python bench/lake_reading.py --lr 3e-3
    python bench/lake_reading.py --model tiny-deep         # four layers
    python bench/lake_reading.py --model DIR               # twice as wide: DIR from nanoagent.models.save_tiny_model(
                                                           #   DIR, hidden_size=256, num_attention_heads=8,
                                                           #   num_key_value_heads=4, intermediate_size=512)
    python bench/lake_reading.py --model DIR --lr 5e-4     # twice as wide, at half the learning rate
    python bench/lake_reading.py --render both             # the grid, then a line with both coordinates
    python bench/lake_reading.py --render coordinates      # coordinates alone (player, goal, holes)
    python bench/lake_reading.py --world_model 1           # and predicting each next grid

The other renders exist only here (registered as their own env, so the warm-up cache keeps them apart).
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the modules live at the repository root
import envs  # noqa: E402
import eval as evaluation  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
from nanoagent.models import load_model  # noqa: E402

parser = argparse.ArgumentParser(description="FrozenLake: a correct-only warm-up's success and first decisions")
parser.add_argument("--model", default="tiny", help="tiny, tiny-deep or a checkpoint directory")
parser.add_argument("--steps", type=int, default=950, help="SFT steps (the game's 800 + 150, all correct)")
parser.add_argument("--levels", type=int, default=3000, help="distinct demonstrated levels (sft.warm_up's)")
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--render", choices=["grid", "both", "coordinates"], default="grid")
parser.add_argument("--world_model", type=float, default=0.0,
                    help="weight of the loss on the next grids (sft.demonstration_loss; the game's: 1)")
parser.add_argument("--maps", type=int, default=256, help="held-out maps for success (eval.py --n)")
parser.add_argument("--decisions", type=int, default=300, help="held-out maps whose first move is read")
args = parser.parse_args()


class ReadLake(envs.FrozenLakeEnv):
    """FrozenLake with --render's observation; the game is the same."""

    def render(self):
        (row, column), (goal_row, goal_column) = self.player, self.goal
        if args.render == "both":
            return (super().render() + f"\nYou: row {row}, column {column}. "
                    f"Goal: row {goal_row}, column {goal_column}.")
        holes = ", ".join(f"({r}, {c})" for r, c in sorted(self.holes)) or "none"
        return f"Player: ({row}, {column})\nGoal: ({goal_row}, {goal_column})\nHoles: {holes}"


env_name = "frozen_lake"
if args.render != "grid":
    env_name = f"frozen_lake_{args.render}"
    envs.ENVS[env_name] = ReadLake
path = sft.warm_up(args.model, env_name, {}, clean_steps=args.steps, steps=0, batch_size=args.batch_size,
                   lr=args.lr, mistake_rate=0.0, num_episodes=args.levels, seed=args.seed,
                   world_model=args.world_model)
evaluation.main(["--model", str(path), "--env", env_name, "--n", str(args.maps), "--temperature", "1.0", "0"])

# The first decision on each held-out map: the moves' first tokens (L, D, R, U) tell them apart.
model, tokenizer = load_model(path)
model.eval()
actions = envs.FrozenLakeEnv.actions
first_tokens = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(action)[0]) for action in actions]
outcomes, by_distance, optimal_mass = Counter(), Counter(), []
for seed in envs.eval_seeds(args.decisions):
    lake = envs.ENVS[env_name]()
    messages, _ = lake.reset(seed)
    distance = len(lake.shortest_path(lake.start))
    optimal = {  # the moves that start a shortest path
        action for action, cell in lake.successors(lake.start)
        if (rest := lake.shortest_path(cell)) is not None and len(rest) == distance - 1
    }
    ids = rollout.encode_chat(tokenizer, messages, add_generation_prompt=True)
    ids += rollout.encode(tokenizer, "<answer>")
    with torch.no_grad():
        probabilities = model(torch.tensor([ids])).logits[0, -1].softmax(-1)[first_tokens]  # (4,)
    optimal_mass.append(sum(float(probabilities[actions.index(action)]) for action in optimal))
    choice = actions[int(probabilities.argmax())]
    cell = lake.clamp(envs.shifted(lake.start, choice))
    outcome = ("right" if choice in optimal else "into a hole" if cell in lake.holes
               else "into the edge" if cell == lake.start else "away from the goal")
    outcomes[outcome] += 1
    by_distance[min(distance, 5), outcome == "right"] += 1

print(f"\nfirst decisions on {args.decisions} held-out maps: mean probability on a shortest path's move "
      f"{sum(optimal_mass) / len(optimal_mass):.3f}; likeliest move: "
      + ", ".join(f"{name} {count}" for name, count in outcomes.most_common()))
for distance in range(1, 6):
    right, wrong = by_distance[distance, True], by_distance[distance, False]
    if right + wrong:
        label = f"goal {distance}{'+' if distance == 5 else ''} move{'s' if distance > 1 else ''} away"
        print(f"  {label}: {right} of {right + wrong} right ({right / (right + wrong):.0%})")
