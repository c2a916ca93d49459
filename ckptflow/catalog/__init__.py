"""What a store holds: listing, verification, tiers, commit and quarantine, verdict records, GC."""
