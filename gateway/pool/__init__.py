"""Pool mode: a gateway in front of remote engine replicas: their registry and health, routing by
outstanding work and prefix affinity, the relay backend, and LoRA adapters across replicas."""
