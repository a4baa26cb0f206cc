"""The replicas behind each pool: health, discovery, in-flight counts and their drivers."""
