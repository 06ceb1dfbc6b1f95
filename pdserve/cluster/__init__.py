"""The local cluster runner: ``pdserve up``, its supervisor, its private Redis, the GPU and KV-tier
layouts."""
