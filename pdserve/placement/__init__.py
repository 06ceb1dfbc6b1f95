"""Where processes run on this machine: its CPU, the engines' cores or GPUs, the prefill/decode
split, pdserve's own threads."""
