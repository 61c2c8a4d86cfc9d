"""The model executor, owned by the scheduler process: model runner (weights, KV pool, request-to-token
table), the per-step ForwardBatch, decode graph runners, memory pools and host-to-device staging."""
