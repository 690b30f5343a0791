"""DeepEP V2's front end: ``ElasticBuffer`` and ``EPHandle`` over the engines V1's ``Buffer`` uses."""
