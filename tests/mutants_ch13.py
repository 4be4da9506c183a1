"""Chapter 13's planted slips and correct rewrites (``tests/test_mutations.py`` runs them).

The slips the chapter's checkers exist for, each a one-line change of a reference solution: a
write-back eviction that drops a dirty node, a host copy spilled while a load-back reads it, a
load-back into device pages that are still someone else's, a disk page trusted after its file
changed -- and the usual ones around them (order, locks, parameters written in, inputs changed in
place, answers right only on lucky inputs).
"""
from __future__ import annotations

from mutant_kinds import Mutant, Rewrite

_CLEAN = "        if v.host_pages:                 # clean: its host copy stays, the device copy goes\n"
_DEVICE_HIT = ("        if node.device_pages:            # on the device already: a hit as it is\n"
               "            continue\n")
_TAKEN = "    taken = [slot // page_size for slot in free_slots[:len(host_pages)]]   # page starts -> page ids\n"
_CHECKSUM = ("    return hashlib.blake2b(payload, digest_size=16).hexdigest() == header[\"checksum\"]"
             "   # from the bytes read now\n")

MUTANTS_CH13 = [
    # --- write_back_eviction -------------------------------------------------------------------
    Mutant("write_back_eviction", _CLEAN, "        if True:\n",
           ("is dirty (no host copy) and you drop it", "a write-back eviction must copy it first"),
           "a write-back eviction that drops a dirty node"),
    Mutant("write_back_eviction", "n.uid not in on_device and n.host_pages and not n.pinned\n",
           "n.uid not in on_device and n.host_pages\n",
           ("read by a load-back in flight (pinned)",), "spills a host copy a load-back still reads"),
    Mutant("write_back_eviction", "if n.uid in on_device and n.uid not in chosen and n.ref_count == 0\n",
           "if n.uid in on_device and n.uid not in chosen\n",
           ("is locked (ref_count",), "evicts a locked node"),
    Mutant("write_back_eviction", "                      and all(c.uid not in on_device or c.uid in chosen for c in children.get(n.uid, []))]\n",
           "                      ]\n", ("still has child", "children go first"), "evicts a parent before its children"),
    Mutant("write_back_eviction", "        victim = min(candidates, key=lambda n: (n.last_access, n.uid))\n",
           "        victim = min(candidates, key=lambda n: n.uid)\n",
           ("goes first (last_access",), "evicts the smallest uid instead of the least recently used", "lucky"),
    Mutant("write_back_eviction", "        elif policy == \"write_back\" and v.num_pages <= room:\n",
           "        elif v.num_pages <= room:\n",
           ("nothing is copied at eviction: forget it",), "copies at eviction whatever the policy", "param"),
    Mutant("write_back_eviction", "            room -= v.num_pages          # dirty: copied to host memory before its pages go\n",
           "", ("[not enough room even after spilling: the first copies take it]",),
           "every copy takes the same room"),
    Mutant("write_back_eviction", "    while room < want:                   # host room",
           "    while room <= want:                   # host room", ("is not needed: the copies fit already",),
           "spills one leaf more than the copies need"),
    Mutant("write_back_eviction", "    victims, chosen, freed = [], set(), 0\n",
           "    nodes.sort(key=lambda n: n.last_access)\n    victims, chosen, freed = [], set(), 0\n",
           ("your code changed `nodes`",), "sorts the caller's nodes in place", "input"),
    # --- load_back_plan ------------------------------------------------------------------------
    Mutant("load_back_plan", _TAKEN, "    taken = list(free_slots[:len(host_pages)])\n",
           ("a load-back into pages still owned by someone else",),
           "takes a free page's first slot for the page: a page owned by someone else"),
    Mutant("load_back_plan", _DEVICE_HIT, "",
           ("the nodes on the device are hits already",), "loads the device hit again"),
    Mutant("load_back_plan", "free_slots[:len(host_pages)]]", "free_slots[len(free_slots) - len(host_pages):]]",
           ("the pages come from the front of the free list",), "takes the pages from the back of the free list"),
    Mutant("load_back_plan", "for i in range(page_size)]", "for i in range(4)]",
           ("slots: position",), "a page size of 4 written in", "param"),
    Mutant("load_back_plan", "    copies = list(zip(host_pages, taken))\n",
           "    copies = list(zip(sorted(host_pages), taken))\n",
           ("copy",), "pairs the host pages in their numbers' order (right while they are in order)", "lucky"),
    Mutant("load_back_plan", "    host_pages = []\n", "    host_pages = []\n    path.reverse()\n",
           ("your code changed `path`",), "reverses the caller's path in place", "input"),
    # --- trusted_page --------------------------------------------------------------------------
    Mutant("trusted_page", _CHECKSUM, "    return bool(header[\"checksum\"])\n",
           ("a disk page trusted after its file changed",), "takes the header's checksum on trust"),
    Mutant("trusted_page", "chain_hash(parent, tokens).hex()", "chain_hash(None, tokens).hex()",
           ("refused a good page",), "hashes the page without its parent"),
    Mutant("trusted_page", "            identity.model, identity.dtype, list(identity.shape), identity.page_size):\n",
           "            header[\"model\"], identity.dtype, list(identity.shape), identity.page_size):\n",
           ("the header is another model's",), "trusts another model's page"),
    Mutant("trusted_page", "    if len(payload) != header[\"payload_bytes\"] or len(payload) != identity.payload_bytes:\n",
           "    if len(payload) != header[\"payload_bytes\"]:\n",
           ("payload_bytes is not what a page of this layout holds",), "believes the header's length"),
    Mutant("trusted_page", "    if len(tokens) != identity.page_size or", "    if len(tokens) != 4 or",
           ("page_size",), "a page size of 4 written in", "param"),
    Mutant("trusted_page", "    fields = (\"model\",", "    header.pop(\"shape\", None)\n    fields = (\"model\",",
           ("your code changed `header`",), "removes a field of the caller's header", "input"),
]

REWRITES_CH13 = [
    Rewrite("write_back_eviction", "        victim = min(candidates, key=lambda n: (n.last_access, n.uid))\n",
            "        victim = sorted(candidates, key=lambda n: (n.last_access, n.uid))[0]\n",
            "the oldest victim by a sort"),
    Rewrite("write_back_eviction", "    return actions, spills\n", "    return tuple(actions), tuple(spills)\n",
            "victims and spills as tuples"),
    Rewrite("load_back_plan", _TAKEN, "    taken = [free_slots[i] // page_size for i in range(len(host_pages))]\n",
            "the pages taken by index"),
    Rewrite("load_back_plan", "    copies = list(zip(host_pages, taken))\n",
            "    copies = [[h, d] for h, d in zip(host_pages, taken)]\n", "copies as lists"),
    Rewrite("trusted_page", _CHECKSUM,
            "    import hmac\n    digest = hashlib.blake2b(payload, digest_size=16).hexdigest()\n"
            "    return hmac.compare_digest(digest, header[\"checksum\"])\n", "the checksum compared in constant time"),
    Rewrite("trusted_page", "    fields = (\"model\",",
            "    from kvlab.prefix.disk_store import trust_reason\n"
            "    return trust_reason(identity, parent, tokens, header, payload) == \"\"\n    fields = (\"model\",",
            "kvlab.prefix.disk_store.trust_reason"),
]

#: the classes of slips each exercise can have (tests/test_mutations.py's APPLIES)
APPLIES_CH13 = {
    "write_back_eviction": {"input", "param", "lucky"},
    "load_back_plan": {"input", "param", "lucky"},
    "trusted_page": {"input", "param"},
}
