"""KV caches: rolled back to the accepted path, grown in place, shared by many sequences.

* ``rollback``: a single sequence's cache (`new_cache`), cut back after a verification
  (`truncate_cache`, `keep_accepted`) without re-encoding the prefix;
* ``slab``: a cache layer with spare capacity, so a forward appends in place (`SlabLayer`);
* ``ragged``: one cache for the rows of a batch, of different lengths, with holes masked
  (`RaggedCache`, fed a `RowInput` per row);
* ``windows``: sliding-window attention on caches that keep every token (the window in the mask),
  and the one-line refusal of layer kinds the engine cannot serve.
* ``row_attention``: attention one query at a time over exactly its own keys, for a model that
  rounds its rows (an int8 target), so a verify's rows equal one-token forwards bit for bit.
"""

from inference.engine.kv.ragged import RaggedCache, RowInput
from inference.engine.kv.rollback import keep_accepted, new_cache, truncate_cache
from inference.engine.kv.slab import SlabLayer

__all__ = ["RaggedCache", "RowInput", "SlabLayer", "keep_accepted", "new_cache", "truncate_cache"]
