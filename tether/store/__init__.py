"""What Tether keeps: the fleet's key ring, the payload codec, the effect ledger, PostgreSQL and its roles."""
