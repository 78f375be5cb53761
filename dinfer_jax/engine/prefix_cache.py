"""Prefix reuse across requests for block diffusion (LLaDA2): a block-level radix cache of prompt K/V.

Under the block-causal mask the K/V of a prompt's block j are a function of the tokens of its blocks 0..j
alone (their positions follow from j). So two prompts that share their first h whole blocks share those
blocks' K/V exactly, whatever comes after and whatever canvas pads them. The store keeps them:

- a radix tree over whole prompt blocks, a node per block, each child keyed by its block's tokens exactly (a
  tuple, not a hash: no collision can serve another prompt's K/V);
- a paged device buffer [pages + 1, n_layers, 2, L, K, H] holding each node's K/V (page 0 is a sink: gathers
  of blocks that miss read it and writes of blocks not kept go to it). It starts small and doubles up to the
  budget as blocks arrive, so a budget is a ceiling, not memory taken at start. Only the gather and the
  scatter (`read`, `write`) see the buffer's size: a new size recompiles those two small programs, never a
  prefill forward;
- LRU over leaves within a byte budget. A lookup touches its path from the deepest node up to the root, so a
  parent's stamp is never older than its children's and the least recently used node is always a leaf: the
  tree never loses an inner node while a descendant stays.

A hit is copied into the row's own K/V (engine.slots: the pool's state), so evicting an entry later never
changes a running row, and an answer with the store equals the answer without it: the reused K/V are those a
prefill of the same blocks computes (tests: tokens equal to the prompt alone, fp32).

One store serves one model and one block length (pools of other canvas geometries share it: pads before the
prompt are masked, so they do not enter the K/V). Not thread-safe: the engine thread owns it.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.config import ModelConfig

INITIAL_PAGES = 16


@dataclasses.dataclass(eq=False)
class _Node:
  parent: "_Node | None"
  key: tuple[int, ...]
  page: int
  stamp: int = 0
  children: dict[tuple[int, ...], "_Node"] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PrefixStats:
  """Counts since the store was made: prompt blocks looked up that hit and that missed, blocks stored and
  evicted, and prefill forwards saved (rows whose every whole prompt block hit)."""
  hit_blocks: int = 0
  miss_blocks: int = 0
  stored_blocks: int = 0
  evicted_blocks: int = 0
  prefills_saved: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """One row's prefill against the store: per canvas block of the prompt region [0, C) the page to read
  (`read`, the sink where the block is not a hit) and the page to write its fresh K/V to (`write`, the sink
  for blocks not kept); `hit` whole prompt blocks reused; `width`: the prefill forward's query width (a
  power of two of blocks holding every block after the hits; 0: nothing to compute)."""
  read: np.ndarray
  write: np.ndarray
  hit: int
  width: int


class PrefixStore:
  """The block-level prefix cache (see the module docstring).

  Args:
    mcfg: the model whose K/V it holds.
    block_len: L, the block length of the generation configs it serves.
    dtype: the K/V dtype (the model's activation dtype).
    budget_bytes: the device bytes its pages may take (`serve --prefix-cache-mb`); at least one page.
  """

  def __init__(self, mcfg: ModelConfig, block_len: int, dtype, budget_bytes: int):
    self.block_len = block_len
    self.page_shape = (mcfg.n_layers, 2, block_len, mcfg.n_kv_heads, mcfg.head_dim)
    self.page_bytes = int(np.prod(self.page_shape)) * jnp.dtype(dtype).itemsize
    self.n_pages = int(budget_bytes) // self.page_bytes
    if self.n_pages < 1:
      raise ValueError(f"PrefixStore: a budget of {budget_bytes} bytes holds no block (one block's K/V takes "
                       f"{self.page_bytes} bytes at block_length={block_len}); raise --prefix-cache-mb or "
                       f"set it to 0 to turn the cache off")
    self.sink = 0
    self.pages = jnp.zeros((1,) + self.page_shape, dtype)
    self._root = _Node(None, (), -1)
    self._free: list[int] = []
    self._grow(min(self.n_pages, INITIAL_PAGES))
    self._clock = itertools.count(1)
    self._n_nodes = 0
    self.stats = PrefixStats()

  def _grow(self, pages: int) -> None:
    have = self.pages.shape[0] - 1
    self.pages = jnp.concatenate([self.pages, jnp.zeros((pages - have,) + self.page_shape, self.pages.dtype)])
    self._free = list(range(pages, have, -1)) + self._free

  def _page(self, pinned: set[int]) -> int | None:
    """A free page: a free one, else the buffer doubled (up to the budget), else the least recently used
    leaf's off the pinned path."""
    if not self._free and self.pages.shape[0] - 1 < self.n_pages:
      self._grow(min(self.n_pages, 2 * (self.pages.shape[0] - 1)))
    return self._free.pop() if self._free else self._evict_one(pinned)

  @property
  def used_bytes(self) -> int:
    return self._n_nodes * self.page_bytes

  def _match(self, blocks: Sequence[tuple[int, ...]]) -> list[_Node]:
    path, node = [], self._root
    for b in blocks:
      node = node.children.get(b)
      if node is None:
        break
      path.append(node)
    return path

  def _touch(self, path: list[_Node]) -> None:
    for node in reversed(path):  # deepest first: a parent's stamp is never older than its children's
      node.stamp = next(self._clock)

  def _evict_one(self, pinned: set[int]) -> int | None:
    """Frees the least recently used leaf not in `pinned` (ids); returns its page, None when none can go."""
    best, stack = None, list(self._root.children.values())
    while stack:
      n = stack.pop()
      if n.children:
        stack.extend(n.children.values())
      elif id(n) not in pinned and (best is None or n.stamp < best.stamp):
        best = n
    if best is None:
      return None
    del best.parent.children[best.key]
    self._n_nodes -= 1
    self.stats.evicted_blocks += 1
    return best.page

  def plan(self, blocks: Sequence[tuple[int, ...]], first_block: int, prefill_len: int) -> Plan:
    """Looks up a row's whole prompt blocks (in order, as token tuples of block_len) and reserves pages for
    the ones that miss, evicting least recently used leaves off the row's path as needed (blocks that find
    no page are not kept). first_block: the canvas block of the prompt's block 0; prefill_len: C, the canvas
    columns before the row's first decoding block (a multiple of block_len)."""
    L = self.block_len
    nb = prefill_len // L
    if first_block + len(blocks) != nb or any(len(b) != L for b in blocks):
      raise ValueError(f"PrefixStore.plan: {len(blocks)} blocks of {L} tokens from canvas block {first_block} do "
                       f"not fill the {nb} blocks before the first decoding block")
    path = self._match(blocks)
    h = len(path)
    read = np.full(nb, self.sink, np.int32)
    write = np.full(nb, self.sink, np.int32)
    for i, node in enumerate(path):
      read[first_block + i] = node.page
    pinned = {id(n) for n in path}
    parent = path[-1] if path else self._root
    for i in range(h, len(blocks)):
      page = self._page(pinned)
      if page is None:
        break
      node = _Node(parent, blocks[i], page)
      parent.children[blocks[i]] = node
      self._n_nodes += 1
      self.stats.stored_blocks += 1
      write[first_block + i] = page
      path.append(node)
      pinned.add(id(node))
      parent = node
    self._touch(path)
    self.stats.hit_blocks += h
    self.stats.miss_blocks += len(blocks) - h
    missing = nb - (first_block + h)  # blocks from the first one after the hits to C
    width = 0 if missing == 0 else min(nb, 1 << (missing - 1).bit_length()) * L
    if width == 0 and blocks:
      self.stats.prefills_saved += 1
    return Plan(read, write, h, width)

  def read(self, plan: Plan):
    """The row's K/V columns [0, C) as the plan's hits give them: per-layer K and V [1, C, K, H] (blocks that
    miss hold what the sink holds: the prefill recomputes them, or they are masked pads)."""
    return _gather_jit()(self.pages, plan.read)

  def write(self, plan: Plan, k, v) -> None:
    """Keeps the row's blocks the plan reserved pages for, from its K/V columns [0, C)."""
    if (plan.write != self.sink).any():
      self.pages = _scatter_jit()(self.pages, plan.write, k, v)

  def check(self) -> None:
    """Invariants (tests): the pages in use and the free ones partition the buffer's pages [1, size], every
    parent is at least as recent as its children."""
    used, stack = [], [self._root]
    while stack:
      n = stack.pop()
      for c in n.children.values():
        used.append(c.page)
        assert n is self._root or n.stamp >= c.stamp, "a parent older than its child"
        stack.append(c)
    assert len(used) == self._n_nodes and sorted(used + self._free) == list(range(1, self.pages.shape[0]))


def gather_blocks(pages: jax.Array, read: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """pages [P + 1, n_layers, 2, L, K, H], read [nb] -> per-layer K and V [1, nb * L, K, H] (a row's cache
  columns [0, nb * L); blocks that read the sink hold whatever it holds: the prefill recomputes them or they
  are masked pads)."""
  g = pages[read]  # [nb, n_layers, 2, L, K, H]
  nb, nl, _, L, K, H = g.shape
  g = jnp.moveaxis(g, 0, 2).reshape(nl, 2, 1, nb * L, K, H)
  return tuple(g[i, 0] for i in range(nl)), tuple(g[i, 1] for i in range(nl))


@functools.cache
def _gather_jit():
  return jax.jit(gather_blocks)


@functools.cache
def _scatter_jit():
  # The pages are replaced in place on accelerators (CPU ignores donation).
  return jax.jit(scatter_blocks, donate_argnums=(0,) if jax.default_backend() != "cpu" else ())


def scatter_blocks(pages: jax.Array, write: jax.Array, k: Sequence[jax.Array], v: Sequence[jax.Array]) -> jax.Array:
  """Writes a row's per-layer K and V [1, nb * L, K, H] into the pages `write` [nb] names (the sink for
  blocks not kept: what lands there is never read as a hit)."""
  nb, L = write.shape[0], pages.shape[3]
  kv = jnp.stack([jnp.stack([kl[0], vl[0]]) for kl, vl in zip(k, v)])  # [n_layers, 2, nb * L, K, H]
  kv = kv.reshape(kv.shape[:2] + (nb, L) + kv.shape[3:])
  return pages.at[write].set(jnp.moveaxis(kv, 2, 0).astype(pages.dtype))
