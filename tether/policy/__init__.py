"""Policy: the policy file (TOML and the Cedar files it names), Cedar, signatures, the judgement log."""
