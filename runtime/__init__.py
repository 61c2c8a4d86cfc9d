"""radixgen's engine: config, messages, request state, memory, scheduler, models, Engine."""
