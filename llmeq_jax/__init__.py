"""llmeq_jax: JAX/XLA-native quantization of large language models."""

import os

# transformers is used for tokenizers (and, in the tests, as a PyTorch reference). Without
# PyTorch installed (`scripts/main_job.sh` installs no torch) it logs "PyTorch was not found.
# Models won't be available ..." as an advisory warning on import, which says nothing about
# llmeq. Advisories are off unless the user set the variable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
