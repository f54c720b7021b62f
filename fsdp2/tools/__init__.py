"""Tools around the runtime: communication-byte counter, memory estimator and its dry run, allocator peak meter."""
