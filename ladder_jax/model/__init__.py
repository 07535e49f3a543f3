"""The model: the Transformer and its modules (`transformer`), the residual wiring every scheme
runs (`residual`), and where weights, caches and activations live on the mesh, with the
collectives spelled out (`sharding`)."""
