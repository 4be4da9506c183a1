"""Chapter 13's third exercise: ``kvlab.check.trusted_page(fn)``.

``fn(identity, parent, tokens, header, payload) -> bool``: may a page read from the disk store be
loaded? The page wanted holds ``tokens`` (one page) after the page whose chained hash is
``parent`` (``None`` for a prompt's first page), for the model and layout ``identity`` (a
:class:`kvlab.prefix.disk_store.KVIdentity`); the file gave ``header`` (a dict: ``model``,
``dtype``, ``shape``, ``page_size``, ``page_hash`` in hex, ``payload_bytes``, ``checksum``: BLAKE2b-
128 of the payload in hex) and ``payload`` (bytes). True only when the header is this model's and
layout's, names this very page (chapter 11's chained hash of ``tokens`` after ``parent``), the
payload has exactly the bytes a page of this layout holds and its checksum, **computed from the
payload as read now**, is the header's. Every argument is read-only.

The cases are real files of the store (``kvlab.prefix.disk_store.encode_page``) with one thing
wrong each: another model, dtype, page size or shape, the page of another prefix, the page hashed
without its parent, a payload cut short, one flipped bit of the payload with the header
untouched, a header that lies about its checksum or its length, a missing field.
"""
from __future__ import annotations

import hashlib
import random

import torch

from ...prefix.disk_store import KVIdentity, decode_page, encode_page
from ...prefix.hash_chain import chain_hash
from ...prefix.host_tier import KVLayout
from ..checking.core import Case, CheckFailed, call_learner, exercise, run_cases
from ..reference.hierarchy_ref import trusted_ref


def trusted_page_solution(identity, parent, tokens, header, payload):
    """True when the stored page may be loaded: this model's, this page, intact."""
    fields = ("model", "dtype", "shape", "page_size", "page_hash", "payload_bytes", "checksum")
    if not isinstance(header, dict) or any(f not in header for f in fields):
        return False
    if (header["model"], header["dtype"], list(header["shape"]), header["page_size"]) != (
            identity.model, identity.dtype, list(identity.shape), identity.page_size):
        return False                                      # another model's, or another layout
    if len(tokens) != identity.page_size or header["page_hash"] != chain_hash(parent, tokens).hex():
        return False                                      # another page (another prefix)
    if len(payload) != header["payload_bytes"] or len(payload) != identity.payload_bytes:
        return False                                      # cut short, or a header that lies
    return hashlib.blake2b(payload, digest_size=16).hexdigest() == header["checksum"]   # from the bytes read now


#: what each case does to a good file, and why that file must not be trusted
DEFECTS = {
    "good": "",
    "another model": "the header is another model's: the same tokens give other K/V there",
    "another dtype": "the header's dtype is not this layout's",
    "another page size": "the header's page size is not this layout's",
    "another shape": "the header's shape is not this layout's",
    "another prefix": "the page was stored after another parent page: the same tokens after other ones "
                      "have other K/V (the hash must chain from the parent)",
    "hashed without its parent": "the header's hash is of the tokens alone: compare with the CHAINED hash",
    "payload cut short": "the payload is shorter than a page (payload_bytes)",
    "a flipped bit in the payload": "a byte of the payload changed after the file was written: the header's "
                                    "checksum says what the bytes were then -- compute it from the bytes read now "
                                    "(a disk page trusted after its file changed)",
    "a checksum that lies": "the header's checksum is not the payload's",
    "a header that lies about its length": "payload_bytes is not what a page of this layout holds",
    "a missing field": "the header lacks a field: nothing to compare it with",
    "one token of the page differs": "the page asked for holds other tokens than the stored one",
}


def _identity(model: str, P: int, dtype=torch.float32) -> KVIdentity:
    return KVIdentity.of(model, KVLayout(2, 2, 3, dtype), P)


def _case_args(defect: str, rng: random.Random, P: int, first: bool = False):
    """A file of the store for the page wanted, with ``defect`` (``first``: a prompt's first page)."""
    ident = _identity("llama-7f3a", P)
    first = first and defect != "hashed without its parent"
    parent = None if first else chain_hash(None, [rng.randrange(300) for _ in range(P)])
    tokens = [rng.randrange(300) for _ in range(P)]
    page = torch.randn(ident.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    stored_ident, stored_parent, stored_tokens = ident, parent, list(tokens)
    if defect == "another model":
        stored_ident = _identity("qwen2-91bc", P)
    elif defect == "another dtype":
        stored_ident = _identity("llama-7f3a", P, torch.float64)
        page = page.double()
    elif defect == "another page size":
        stored_ident = ident._replace(page_size=P + 1)
    elif defect == "another shape":
        stored_ident = ident._replace(shape=(3,) + tuple(ident.shape[1:]))
    elif defect == "another prefix":
        stored_parent = chain_hash(parent, [7] * P)
    elif defect == "one token of the page differs":
        stored_tokens[rng.randrange(P)] += 1
    page_hash = chain_hash(None if defect == "hashed without its parent" else stored_parent, stored_tokens)
    header, payload = decode_page(encode_page(stored_ident, page_hash, page))
    if defect == "payload cut short":
        payload = payload[: -rng.randint(1, 9)]
    elif defect == "a flipped bit in the payload":
        raw = bytearray(payload)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        payload = bytes(raw)
    elif defect == "a checksum that lies":
        header["checksum"] = hashlib.blake2b(b"another page", digest_size=16).hexdigest()
    elif defect == "a header that lies about its length":
        header["payload_bytes"] -= 4
        payload = payload[:-4]
        header["checksum"] = hashlib.blake2b(payload, digest_size=16).hexdigest()
    elif defect == "a missing field":
        del header[rng.choice(["checksum", "model", "page_hash"])]
    return dict(identity=ident, parent=parent, tokens=tokens, header=header, payload=payload)


def _cases(seed: int, n_random: int) -> list[Case]:
    rng = random.Random(seed)
    cases = [Case(f"{d} (page_size 4)", dict(defect=d, **_case_args(d, rng, 4)), "edge") for d in DEFECTS]
    cases.insert(1, Case("good, a prompt's first page (page_size 2)",
                         dict(defect="good", **_case_args("good", rng, 2, first=True)), "edge"))
    cases.insert(2, Case("another prefix, a prompt's first page asked (page_size 2)",
                         dict(defect="another prefix", **_case_args("another prefix", rng, 2, first=True)), "edge"))
    for i in range(n_random):
        d, P = rng.choice(list(DEFECTS)), rng.choice([1, 2, 4, 16])
        cases.append(Case(f"random {i + 1} ({d}, page_size {P})",
                          dict(defect=d, **_case_args(d, rng, P, first=rng.random() < 0.2)), "random"))
    return cases


@exercise(
    "trusted_page",
    chapter="13",
    hints=[
        "Compare the header with what THIS model would have written for THIS page: model, dtype, shape "
        "and page_size from identity; page_hash with chain_hash(parent, tokens).hex() (chapter 11's "
        "chained hash: the tokens alone are not the page).",
        "Then the payload: exactly identity.payload_bytes bytes, and header['payload_bytes'] the same.",
        "Last, hashlib.blake2b(payload, digest_size=16).hexdigest() == header['checksum']: computed from "
        "the bytes you read, never taken from the header alone (a file can change after it was written).",
    ],
    solution=trusted_page_solution,
    order=3,
)
def trusted_page(fn, *, seed: int = 0, n_random: int = 16) -> int:
    """Check ``fn(identity, parent, tokens, header, payload) -> bool``."""

    def run_one(case: Case) -> None:
        a = case.args
        want = not trusted_ref(a["identity"], a["parent"], a["tokens"], a["header"], a["payload"])
        assert want == (a["defect"] == "good"), a["defect"]
        got = call_learner(fn, a["identity"], a["parent"], list(a["tokens"]), dict(a["header"]), a["payload"],
                           read_only=(2, 3))
        if not isinstance(got, bool):
            raise CheckFailed(f"[{case.name}] return True or False, got {type(got).__name__} {got!r}"[:200],
                              case=case.name)
        if got == want:
            return
        if got:
            raise CheckFailed(f"[{case.name}] trusted a page that must not be loaded: {DEFECTS[a['defect']]}",
                              case=case.name, label=a["defect"])
        raise CheckFailed(f"[{case.name}] refused a good page: it is this model's, this page (chained hash "
                          f"{a['header']['page_hash'][:12]}...), {len(a['payload'])} bytes, checksum right",
                          case=case.name, label="good")

    return run_cases("trusted_page", _cases(seed, n_random), run_one)
