"""flashpd: disaggregated prefill/decode serving for DeepSeek-V4.1-Flash.

The import namespace `flashpd` maps onto the repository's top-level folders
(`flashpd.model` -> model/, `flashpd.engine` -> engine/, `flashpd.kernels` -> kernels/,
`flashpd.services` -> services/, `flashpd.bench` -> bench/); see setup.py.
"""

__version__ = "0.1.0"
