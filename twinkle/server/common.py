"""`from twinkle.server.common import input_feature_to_datum`: the import path the product documentation gives
users for the InputFeature → Datum conversion (twinkle/input_feature.py, which the pool workers import)."""

from twinkle.input_feature import datum_from_input_feature, input_feature_to_datum

__all__ = ["datum_from_input_feature", "input_feature_to_datum"]
