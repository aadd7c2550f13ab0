"""ortflow: data-parallel training of ONNX models with ONNX Runtime, as a Snakemake workflow."""

__version__ = "0.1.0"
