"""bole_jax: tree speculative decoding for hybrid-attention LLMs in JAX with Pallas kernels."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import bole_jax` stays cheap (no JAX init) for the CLI's --help and for tooling.
    if name == "LLM":
        from bole_jax.llm import LLM

        return LLM
    if name == "KernelOptions":
        from bole_jax.pallas.options import KernelOptions

        return KernelOptions
    if name == "ModelConfig":
        from bole_jax.model import ModelConfig

        return ModelConfig
    if name == "WeightsDoNotFit":
        from bole_jax.model.parallel import WeightsDoNotFit

        return WeightsDoNotFit
    raise AttributeError(name)
