"""Writing an output folder: streamed shards, the manifest, config.json's quantization_config."""
