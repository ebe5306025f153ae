"""Privacy mechanisms that protect what silos send: secure aggregation (secagg)."""
