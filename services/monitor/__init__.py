"""Monitoring's bookkeeping: store a batch once, fold the judgement into link health and
fault incidents (with their events) in the same transaction, answer preflight from them,
and the fleet's read models. The judgement itself is services.analyzer's."""
