"""Who is calling and what they may do: identity, the tenant directory, admission and limits."""
