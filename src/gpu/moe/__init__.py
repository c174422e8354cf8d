"""Mixture-of-experts layers: routing (`router`), the grouped expert computation on CPU
(`grouped`, the oracle of the Triton kernel in `triton_moe`), the layer that owns the stacked
expert weights and their tensor- or expert-parallel split (`layer`), and the expert-parallel
token dispatch (`dispatch`)."""
