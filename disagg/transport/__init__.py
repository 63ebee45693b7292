"""Weight transport: bucket planning, packing, process groups, sender and receiver."""
