"""Write o200k_base.tiktoken, the vocabulary openai-harmony reads (gpt-oss's
chat format), into a folder: ``TIKTOKEN_ENCODINGS_BASE`` then points there.

    python scripts/harmony_vocab.py FOLDER

openai-harmony downloads the file from OpenAI's blob store on first use;
a machine that cannot reach it takes the same ranks from npm's ``tiktoken``
package (its ``encoders/o200k_base.json``), rewritten in the tiktoken file
format and checked against the file's published SHA-256. A deployment of a
real gpt-oss checkpoint needs neither: the server derives the file from
the checkpoint's own tokenizer (``appliance/server/harmony.py``).

Exits 0 with a note on stderr when the registry cannot be reached (the
harmony tests then skip, saying why), 1 when what it fetched is wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "https://registry.npmjs.org/tiktoken/-/tiktoken-1.0.22.tgz"
MEMBER = "package/encoders/o200k_base.json"
NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def tiktoken_file(bpe_ranks: str) -> bytes:
    """npm tiktoken's ``bpe_ranks`` (lines ``! FIRST_RANK TOKEN TOKEN ...``, base64 tokens of consecutive
    ranks) as the tiktoken file: one ``TOKEN RANK`` line per rank, in rank order."""
    ranks = []
    for line in bpe_ranks.split("\n"):
        if not line:
            continue
        _, first, *tokens = line.split(" ")
        ranks += [(int(first) + i, t) for i, t in enumerate(tokens)]
    ranks.sort()
    return "".join(f"{t} {r}\n" for r, t in ranks).encode()


def main(folder: str) -> int:
    out = Path(folder) / NAME
    if out.exists() and hashlib.sha256(out.read_bytes()).hexdigest() == SHA256:
        return 0
    try:
        with urllib.request.urlopen(PACKAGE, timeout=60) as r:
            archive = r.read()
    except OSError as e:
        print(f"harmony_vocab: {PACKAGE} cannot be fetched ({e}); gpt-oss's harmony tests will skip",
              file=sys.stderr)
        return 0
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            print(f"harmony_vocab: {MEMBER} is not in {PACKAGE}", file=sys.stderr)
            return 1
        data = tiktoken_file(json.load(member)["bpe_ranks"])
    if hashlib.sha256(data).hexdigest() != SHA256:
        print(f"harmony_vocab: the ranks in {PACKAGE} do not make o200k_base (SHA-256 differs)", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
