"""The data pipeline: prompts -> regenerated answers -> captured hidden states in shards."""
