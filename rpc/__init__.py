"""What the three services share on the wire side: lifecycle, error mapping, proto<->engine conversion."""
