"""ADEPT's stages (docs/methods.md §1): `probe` (Stage 1's layer importance by bypassing each layer),
`placement` (where the k copies go), `expand` (the function-preserving copies), `units` (Stage 2's
per-unit θ·∇θ importance) and `lr` (the decoupled per-unit learning rates from it)."""
