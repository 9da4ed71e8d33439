"""stppo inside other RL engines (verl, ...): adapters that depend on `stppo.algos` and
`stppo.envs`, never the reverse. Importing this package imports nothing heavy (no torch, no engine)."""
