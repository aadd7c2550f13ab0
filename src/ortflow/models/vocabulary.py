"""A tokenizer's ids against the model's embedding (`data.tokenizer`): the table
that looks up the token ids needs a row for every id the tokenizer gives.

The table is found in the forward ONNX graph, not by name: the initializer that
a Gather node reads as its data, with the token-id input (the manifest's
`tokenizer.input`) as its indices, directly or through nodes that only cast or
reshape them (transformers' GPT-2 flattens input_ids before its lookup).
"""

from __future__ import annotations

import logging

from ..errors import ModelError

log = logging.getLogger("ortflow.build_artifacts")

# Nodes that pass token ids on unchanged in value, on their first input.
PASS_THROUGH = ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def token_embedding(base, ids: str) -> tuple[str, int] | None:
    """(name, rows) of the embedding table that input `ids` indexes, or None."""
    tables = {t.name: t.dims[0] for t in base.graph.initializer if len(t.dims) == 2}
    names, seen = [ids], {ids}
    while names:
        name = names.pop(0)
        for node in base.graph.node:
            if node.op_type == "Gather" and node.input[1] == name and node.input[0] in tables:
                return node.input[0], int(tables[node.input[0]])
            if node.op_type in PASS_THROUGH and node.input[0] == name and node.output[0] not in seen:
                seen.add(node.output[0])
                names.append(node.output[0])
    return None


def check(base, manifest) -> None:
    """Refuse a table with fewer rows than the tokenizer's vocabulary (its ids would
    index past it); warn about more rows (never looked up, as where a model pads its
    vocabulary to a round size)."""
    tokenizer = manifest.tokenizer
    if not tokenizer:
        return
    vocab, ids = tokenizer["vocab_size"], tokenizer["input"]
    found = token_embedding(base, ids)
    if found is None:
        log.warning("no embedding table looks up the input %r in the model: the vocabulary of data.tokenizer %s (%d) "
                    "is not checked against it", ids, tokenizer["source"], vocab)
        return
    table, rows = found
    described = (f"data.tokenizer {tokenizer['source']} has a vocabulary of {vocab} token ids, the model's embedding "
                 f"{table!r} (which looks up {ids!r}) {rows} rows")
    if rows < vocab:
        raise ModelError(f"{described}: ids {rows} and up would index past it; build the model with a vocabulary of "
                         f"{vocab} (e.g. vocab_size in model.kwargs)")
    if rows > vocab:
        log.warning("%s: rows %d and up are never looked up", described, vocab)
    else:
        log.info("%s: they match", described)
