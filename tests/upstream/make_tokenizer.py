"""Write the small stand-in tokenizer that some hf-configs/ entries carry.

The upstream tests build a tokenizer for some models (the structured-output
manager of a scheduler does); the real ones are large downloads. This makes a
WordLevel tokenizer with the model's special tokens and a few hundred plain
words, saved as files in the entry. Run it only to regenerate them:

    .venv/bin/python tests/upstream/make_tokenizer.py
"""

import string
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent / "hf-configs"
# entry -> (special tokens in id order, bos, eos, pad, base vocabulary size, added special tokens).
# The added tokens get the ids right after the base vocabulary, as in the real
# tokenizer (llava's <image> must be 32000, its config's image_token_index).
ENTRIES = {
    "llava-hf__llava-1.5-7b-hf": (["<unk>", "<s>", "</s>"], "<s>", "</s>", "<pad>", 32000, ["<image>", "<pad>"]),
}
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def words(count: int) -> list[str]:
    """`count` plain tokens: letters, two-letter words, digits, punctuation, then fillers."""
    letters = string.ascii_lowercase
    out = list(letters) + [a + b for a in letters for b in letters] + list(string.digits) + list(".,!?:;'-")
    out += [f"w{i}" for i in range(count - len(out))]
    return out[:count]


def build(entry: str) -> None:
    specials, bos, eos, pad, base_size, added = ENTRIES[entry]
    vocab = {tok: i for i, tok in enumerate(specials + words(base_size - len(specials)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(added)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=specials[0], bos_token=bos, eos_token=eos,
                                   pad_token=pad, additional_special_tokens=[t for t in added if t != pad],
                                   model_max_length=4096)
    dest = HERE / entry
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        # Compact JSON: the file is committed.
        (Path(tmp) / "tokenizer.json").write_text(fast.backend_tokenizer.to_str(pretty=False))
        for name in FILES:
            src = Path(tmp) / name
            if src.exists():
                (dest / name).write_bytes(src.read_bytes())
                print(f"wrote {dest / name} ({src.stat().st_size} bytes)")


if __name__ == "__main__":
    for entry in sys.argv[1:] or ENTRIES:
        build(entry)
