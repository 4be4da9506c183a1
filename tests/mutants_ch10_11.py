"""The fourth pass over chapters 10-11: slips an independent set of mutants and a learner found
the checkers blind to, by class (``tests/mutant_kinds.py``):

* ``type``: an answer of another type than the statement's, which the next cell cannot use;
* ``unseen``: an answer right on every input the cases had, wrong on one they never had;
* ``blame``: caught, where a message once named another slip than the one made.

``tests/test_mutations.py`` runs them with the rest: each wrong answer is rejected with a
message that names its slip or says nothing about the cause; each rewrite is accepted.
"""
from __future__ import annotations

import collections
import itertools

import torch

from mutant_kinds import Mutant, Rewrite, WrongAnswer

_PAGE = "        parent = chain_hash(parent, input_ids[start:start + page_size])\n"
_MATCH_HASH = "        parent = chain_hash(parent, tokens)\n"
_HIT = ("            cache.take_cached(page)  # a hit: one more reference (a free page leaves the queue)\n"
        "            cached_len += P\n")
_CHECK = ("    for page in set(pages):  # refuse before changing anything: a count never goes below zero\n"
          "        if cache.ref_count[page] < list(pages).count(page):\n"
          "            raise ValueError(f\"page {page} has no reference left to drop\")\n"
          "    for page in reversed(pages):  # the tail of a chain is evicted before its beginning\n"
          "        cache.ref_count[page] -= 1\n")
_STORE = ("    k_pool[slots] = k                                 # all of its K/V heads at once\n"
          "    v_pool[slots] = v\n")
_ATTEND = "    return paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)\n"

MUTANTS_CH10_11 = [
    # --- types the statement fixes ---
    Mutant("page_hashes", "    return hashes\n", "    return tuple(hashes)\n",
           ("[two full pages] return a list of hashes", "got tuple"), "returns a tuple of hashes", "type"),
    Mutant("page_hashes", "        hashes.append(parent)\n", "        hashes.append(parent.hex())\n",
           ("[two full pages] return a list of hashes", "got a list holding str"),
           "returns the hashes as hex strings", "type"),
    Mutant("hash_match", "    return len(pages), slots\n", "    return len(pages), tuple(slots)\n",
           ("[nothing cached] slots should be a list of ints", "got a tuple"), "returns the slots as a tuple",
           "type"),
    Mutant("hash_match", "    return len(pages), slots\n", "    return len(pages), torch.tensor(slots)\n",
           ("[nothing cached] slots should be a list of ints", "tensor"),
           "returns the slots as a tensor", "type"),
    Mutant("hash_match", "    return len(pages), slots\n", "    return float(len(pages)), slots\n",
           ("[nothing cached] num_pages should be an int, got a float: 0.0",),
           "returns the number of pages as a float", "type"),
    Mutant("allocate_pages", "    return pages, cached_len\n",
           "    return torch.tensor(pages), cached_len\n",
           ("[empty cache: every page new, full ones cached] pages should be a list or tuple of ints",
            "got a torch.int64 tensor"), "returns the pages as a tensor", "type"),
    Mutant("allocate_pages", "            cached_len += P\n", "            cached_len += P / 1\n",
           ("[hits on pages in use] cached_len should be an int, got a float: 4.0",),
           "counts cached_len with a true division (a float)", "type"),
    Mutant("pad_decode_batch", "positions.new_zeros(size - n)", "torch.zeros(size - n)",
           ("[5 running requests, captured sizes 1 2 4 8] your code raised IndexError",),
           "pads positions with torch.zeros (float: the cat turns them all float, and they index "
           "nothing)"),
    Mutant("pad_decode_batch", "    positions = torch.cat([positions, positions.new_zeros(size - n)])\n"
           "    return rows, positions, page_table[rows, positions]\n",
           "    padded = torch.zeros(size)  # (then filled)\n    padded[:n] = positions\n"
           "    return rows, padded, page_table[rows, padded.long()]\n",
           ("[5 running requests, captured sizes 1 2 4 8] positions should be an int64 tensor",
            "got torch.float32"), "pads positions in a float tensor", "type"),
    Mutant("pad_decode_batch", "    return rows, positions, page_table[rows, positions]\n",
           "    return rows.tolist(), positions.tolist(), page_table[rows, positions].tolist()\n",
           ("rows should be an int64 tensor", "got a list"), "returns Python lists", "type"),
    Mutant("paged_attention_step", _ATTEND, _ATTEND.rstrip("\n") + ".flatten(1)\n",
           ("the output should have shape (1, 4, 16) ([batch, heads, head_dim]), got (1, 64)",),
           "returns the heads flattened into one row per request", "type"),
    Mutant("paged_attention_step", _STORE,
           "    k_pool.view(len(k_pool), -1)[slots] = k.view(len(k), -1)\n    v_pool[slots] = v\n",
           ("[page_size 1] your code raised RuntimeError", "view size is not compatible"),
           "views k as one row per token (k comes as a strided view, as PagedGenerator hands it over)",
           "type"),
    # --- inputs the cases never had ---
    Mutant("page_hashes", _PAGE,
           "        parent = chain_hash(parent, bytes(input_ids[start:start + page_size]))\n",
           ("your code raised InvalidArgument: page_tokens", "(got bytes)"),
           "hashes a page as its bytes", "unseen"),
    Mutant("page_hashes", "    hashes, parent = [], None\n" "    for start in range(0, len(input_ids) - page_size + 1, page_size):\n" + _PAGE,
           "    hashes, parent = [], None\n"
           "    for start in range(0, len(input_ids) - page_size + 1, page_size):\n"
           "        key = (start // page_size, tuple(input_ids[start:start + page_size]))\n"
           "        parent = _MEMO.setdefault(key, chain_hash(parent, input_ids[start:start + page_size]))\n",
           ("[the same tokens after another first page: [3, 4] after [9, 9]] hash of page 1",),
           "keeps each page's hash by its number and tokens, from one call to the next", "unseen"),
    Mutant("hash_match", "    pages, parent = [], None\n" "    for start in range(0, len(input_ids) - P + 1, P):\n"
           "        tokens = input_ids[start:start + P]\n" + _MATCH_HASH,
           "    pages, parent = [], None\n    for start in range(0, len(input_ids) - P + 1, P):\n"
           "        tokens = input_ids[start:start + P]\n"
           "        parent = _MEMO.setdefault(('match', start // P, tuple(tokens)), chain_hash(parent, tokens))\n",
           ("[[3, 4] cached after [9, 9] (the case before cached it after [1, 2])] matched pages: "
            "expected 2, got 1", "page 1 ([3, 4]) is cached"),
           "keeps each page's hash by its number and tokens, from one call to the next",
           "unseen"),
    Mutant("hash_match", "        pages.append(page)\n    slots",
           "        cache.take_cached(page)  # (a hit)\n        pages.append(page)\n"
           "    cache.free(pages)  # (given back)\n    slots",
           ("[hits on free pages in the middle of the queue", "your code changed `cache`", "the free queue"),
           "takes a reference on each hit and gives them all back (the hits move to the queue's tail)",
           "unseen"),
    Mutant("hash_match", _MATCH_HASH,
           "        parent = chain_hash(parent, [t % 256 for t in tokens])  # (one byte a token)\n",
           ("[token ids past 255] matched pages: expected 2, got 0",),
           "hashes each token as one byte", "unseen"),
    Mutant("hash_match", "        tokens = input_ids[start:start + P]\n",
           "        tokens = list(bytes(input_ids[start:start + P]))  # (compact)\n",
           ("[token ids past 255] your code raised ValueError",), "keeps a page's tokens as bytes", "unseen"),
    Mutant("allocate_pages", _HIT + "        else:\n            hitting = False",
           "            cache.take_cached(page)\n        else:\n"
           "            cached_len = start if hitting else cached_len  # (the hits end here)\n            hitting = False",
           ("[every page of the prompt cached: all hits, nothing new] cached_len should be 8, got 0",),
           "sets cached_len at the first miss (a prompt with no miss keeps 0)", "unseen"),
    Mutant("allocate_pages", "h = chain_hash(parent, tokens) if full else None",
           "h = chain_hash(parent, bytes(tokens)) if full else None",
           ("your code raised InvalidArgument: page_tokens", "(got bytes)"),
           "hashes a page as its bytes", "unseen"),
    Mutant("free_pages", "        if cache.ref_count[page] < list(pages).count(page):",
           "        if cache.ref_count[page] < 1:",
           ("[a page listed twice, with one reference: refuse, change nothing] page",
            "is listed 2 time(s) but holds 1 reference(s)"),
           "checks one reference per page, however often it is listed", "unseen"),
    Mutant("free_pages", _CHECK,
           "    for page in reversed(pages):\n        if cache.ref_count[page] < 1:\n"
           "            raise ValueError(f\"page {page} has no reference left to drop\")\n"
           "        cache.ref_count[page] -= 1\n",
           ("[only the first page has no reference left: refuse, change nothing]",
            "your code raised, as it must, but only after changing the cache"),
           "refuses at the page that has no reference, after freeing the pages behind it", "unseen"),
    Mutant("free_pages", "    for page in reversed(pages):", "    for page in reversed(list(dict.fromkeys(pages))):",
           ("[a page listed twice, with two references: both go]", "ref_count should be 0, got 1"),
           "drops one reference per page however often it is listed", "unseen"),
    Mutant("pad_decode_batch", "    size = next((s for s in sorted(sizes) if s >= n), n)",
           "    size = n if n == 1 else next((s for s in sorted(sizes) if s >= n), n)  # (one needs none)",
           ("[one request, size 1 not captured: pads to 2] every returned tensor has 2 entries",
            "got lengths [1, 1, 1]"), "never pads a batch of one", "unseen"),
    # --- diagnoses that must name the slip made, or none ---
    Mutant("paged_attention_step", _STORE, "    k_pool[slots] = k\n",
           ("request 0's new V should be in slot", "looks like it never stores V"), "never stores V", "blame"),
    Mutant("paged_attention_step", _STORE, "    k_pool[slots] = v\n    v_pool[slots] = k\n",
           ("looks like it swaps K and V",), "stores V in k_pool and K in v_pool", "blame"),
    Mutant("paged_attention_step", _STORE + "    # the new token attends to itself too: positions 0..positions[b], seq_len positions[b] + 1\n" + _ATTEND,
           "    out = paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)\n"
           + _STORE + "    return out\n",
           ("request 0, head", "looks like it attends before writing the new K/V"),
           "attends before it stores the new K/V", "blame"),
    Mutant("paged_attention_step", "positions + 1, scale)", "positions + 1)",
           ("[scale 0.2 (a model's own, not 1/sqrt(head_dim))] request 1, head",
            "looks like it uses 1/sqrt(head_dim) instead of the scale it is given"),
           "leaves the scale out (the kernel's default is 1/sqrt(head_dim))", "param"),
    Mutant("page_hashes", "    hashes, parent = [], None\n" "    for start in range(0, len(input_ids) - page_size + 1, page_size):\n" + _PAGE,
           "    hashes, parent, seen = [], None, {}\n"
           "    for start in range(0, len(input_ids) - page_size + 1, page_size):\n"
           "        page = tuple(input_ids[start:start + page_size])\n"
           "        parent = seen.setdefault(page, chain_hash(parent, page))  # (a page seen before)\n",
           ("[page_size 1: one hash per token] hash of page 2", "looks like a page whose tokens came "
            "earlier in the prompt reuses that page's hash"),
           "reuses the hash of an earlier page with the same tokens", "blame"),
    Mutant("page_hashes", _PAGE, "        parent = chain_hash(None, input_ids[:start + page_size])\n",
           ("[two full pages] hash of page 1", "looks like each page is hashed together with every token "
            "before it, not chained"), "hashes the whole prefix up to the page's end in one call", "blame"),
    Mutant("hash_match", "range(0, len(input_ids) - P + 1, P)", "range(0, len(input_ids) - P, P)",
           ("[the whole prompt cached] matched pages: expected 4, got 3", "page 3 ([7, 8]) is cached, as page"),
           "stops before a last page that is exactly full (silent: any wrong hash of that page "
           "stops the walk there too)", "blame"),
    Mutant("hash_match", "slots = [page * P + i for page in pages for i in range(P)]",
           "slots = [page * P for page in pages]",
           ("slots of the matched pages: expected",), "one slot per page (its first)", "blame"),
    Mutant("pad_decode_batch", "rows.new_full((size - n,), dummy_row)", "rows.new_zeros(size - n)",
           ("rows: ", "(padded entries)", "looks like padded entries use row 0"), "pads with row 0", "blame"),
    Mutant("pad_decode_batch", "positions.new_zeros(size - n)", "positions.new_ones(size - n)",
           ("positions: ", "(padded entries)"), "pads at position 1 (the dummy row maps every position)",
           "value"),
    Mutant("pad_decode_batch", "    size = next((s for s in sorted(sizes) if s >= n), n)",
           "    size = next((s for s in sorted(sizes) if s >= n), max(sizes))",
           ("[larger than every captured size: unpadded] your code raised RuntimeError",),
           "a batch larger than every size cut to the largest", "value"),
    Mutant("allocate_pages", "            cached_len += P\n", "            cached_len += 1\n",
           ("[hits on pages in use] cached_len should be 4, got 2",), "counts cached_len in pages", "value"),
    Mutant("free_pages", "cache.free_queue.append(page)  #", "cache.free_queue.appendleft(page)  #",
           ("[free one sequence: last page first] free queue (head first) should be",),
           "puts a page nobody holds at the head of the queue", "value"),
]


# --- wrong answers of their own shape -------------------------------------------------------


def allocate_new_pages_first(cache, input_ids):
    """takes the new pages from the queue before taking the hits (a hit at the queue's head goes)"""
    from kvlab.prefix.hash_chain import chain_hash

    P, hit = cache.page_size, cache.match(input_ids)
    n_pages = -(-len(input_ids) // P)
    new = [cache.take_free() for _ in range(n_pages - len(hit.pages))]
    for page in hit.pages:
        cache.take_cached(page)
    parent = hit.hashes[-1] if hit.hashes else None
    for k, page in enumerate(new):
        tokens = input_ids[(len(hit.pages) + k) * P:(len(hit.pages) + k + 1) * P]
        if len(tokens) == P:
            h = chain_hash(parent, tokens)
            cache.cache_page(page, h, tokens, parent)
            parent = h
    return list(hit.pages) + new, hit.cached_len


def pad_with_a_python_list(rows, positions, page_table, sizes, dummy_row):
    """returns the padded rows as a list of ints"""
    n = len(rows)
    size = next((s for s in sorted(sizes) if s >= n), n)
    rows = rows.tolist() + [dummy_row] * (size - n)
    positions = torch.cat([positions, positions.new_zeros(size - n)])
    return rows, positions, page_table[torch.tensor(rows), positions]


WRONG_ANSWERS_CH10_11 = [
    WrongAnswer("allocate_pages", allocate_new_pages_first,
                ("[the queue's head is a cached page this prompt hits: hits first, then new pages]",),
                "unseen"),
    WrongAnswer("pad_decode_batch", pad_with_a_python_list,
                ("[5 running requests, captured sizes 1 2 4 8] rows should be an int64 tensor, got a list",),
                "type"),
]

# --- correct rewrites: every form the statement allows ----------------------------------------

REWRITES_CH10_11 = [
    Rewrite("page_hashes", _PAGE, "        parent = chain_hash(parent, tuple(input_ids[start:start + page_size]))\n",
            "each page hashed as a tuple"),
    Rewrite("hash_match", "    return len(pages), slots\n", "    return [len(pages), slots]\n",
            "(num_pages, slots) as a list of two"),
    Rewrite("hash_match", "    slots = [page * P + i for page in pages for i in range(P)]\n",
            "    slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * P + torch.arange(P)).flatten().tolist()\n",
            "the slots computed with torch, handed back as a list of ints"),
    Rewrite("allocate_pages", "    return pages, cached_len\n", "    return tuple(pages), cached_len\n",
            "the pages as a tuple"),
    Rewrite("free_pages", _CHECK,
            "    held = collections.Counter(pages)\n"
            "    if any(cache.ref_count[p] < times for p, times in held.items()):\n"
            "        raise ValueError('a page has no reference left to drop')\n"
            "    for page in reversed(pages):  # the tail of a chain is evicted before its beginning\n"
            "        cache.ref_count[page] -= 1\n",
            "the references counted with a Counter"),
    Rewrite("pad_decode_batch", "    return rows, positions, page_table[rows, positions]\n",
            "    return rows, positions, page_table[rows, positions].long()\n", "the slots as int64"),
    Rewrite("pad_decode_batch", "    size = next((s for s in sorted(sizes) if s >= n), n)",
            "    size = min((s for s in sizes if s >= n), default=n)", "the size as a min with a default"),
    Rewrite("paged_attention_step", _ATTEND, _ATTEND.rstrip("\n") + ".double()\n", "the output in float64"),
    Rewrite("paged_attention_step", _ATTEND,
            "    out = paged_decode_attention(q, k_pool, v_pool, page_table, rows, positions + 1, scale)\n"
            "    return out.transpose(0, 1).contiguous().transpose(0, 1)  # (another memory order)\n",
            "the output in another memory order (not contiguous)"),
    Rewrite("paged_attention_step", _STORE,
            "    for b in range(len(rows)):\n"
            "        slot = int(page_table[rows[b], positions[b]])\n"
            "        k_pool[slot], v_pool[slot] = k[b], v[b]\n",
            "the new K/V stored request by request"),
]


def page_hashes_accumulated(input_ids, page_size):
    """The chain as an accumulation over the full pages."""
    from kvlab.prefix.hash_chain import chain_hash

    pages = [input_ids[s:s + page_size] for s in range(0, len(input_ids) - page_size + 1, page_size)]
    return list(itertools.accumulate([None] + pages, chain_hash))[1:]  # None: the first parent


def allocate_pages_by_the_cache(cache, input_ids):
    """The cache's own allocate: (pages as a tuple, cached_len)."""
    done = cache.allocate(list(input_ids))
    return done.pages, done.cached_len


def free_pages_by_the_cache(cache, pages):
    """The cache's own free (it refuses before it changes anything)."""
    cache.free(list(pages))


def paged_attention_step_by_the_package(q, k, v, k_pool, v_pool, page_table, rows, positions, scale):
    """kvlab.serving.hf.paged_attention_step itself."""
    from kvlab.serving.hf import paged_attention_step

    return paged_attention_step(q, k, v, k_pool, v_pool, page_table, rows, positions, scale)


OTHER_SHAPES_CH10_11 = [("page_hashes", page_hashes_accumulated),
                        ("allocate_pages", allocate_pages_by_the_cache),
                        ("free_pages", free_pages_by_the_cache),
                        ("paged_attention_step", paged_attention_step_by_the_package)]


def mutant_globals() -> dict:
    """Names a mutant's module gets besides its solution module's: a memo of its own (empty at
    first, kept from one call to the next), and the modules the rewrites use."""
    return {"_MEMO": {}, "collections": collections, "torch": torch}
