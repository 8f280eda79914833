"""`draftsmith tune`: a cost model and a sweep that pick the fastest speculative setting per
batch size, and say when not to speculate."""
