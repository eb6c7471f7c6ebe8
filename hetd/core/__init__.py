"""The training core: the engine (the single writer), the parameter store, the downlink, rates and push ingest."""
