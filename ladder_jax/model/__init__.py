"""The model: the Transformer (`transformer`), the residual wiring of every scheme (`residual`,
`decode`, `desync`) and its layout on the mesh (`sharding`)."""
