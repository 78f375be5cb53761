"""A random MoE layer's inputs for kernel-vs-loop tests: hidden states, fp32 experts, distinct top-k
routes and softmax weights."""
import jax
import jax.numpy as jnp
import numpy as np


def random_moe(T: int, D: int, F: int, E: int, k: int, seed: int = 0):
  """(h [T, D], w [T, k], idx [T, k], experts {gate, up: [E, D, F], down: [E, F, D]}), fp32."""
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  ex = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
        for n, s in (("gate", (E, D, F)), ("up", (E, D, F)), ("down", (E, F, D)))}
  idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
  w = jax.nn.softmax(jnp.asarray(rng.standard_normal((T, k)), jnp.float32), axis=-1)
  return h, w, idx, ex
