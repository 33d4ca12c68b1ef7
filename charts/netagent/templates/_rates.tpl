{{- /*
netagent.rate: one rate value checked as the parser reads it (core/quantity.py: RATE_PATTERN, at most
RATE_MAX_CHARS = 32 characters, at most 2^53 bit/s; zero refused where the field needs a rate above
zero), failing the render with the value's path, what is expected and an example; renders the
rate's exact sort key ("<position of the decimal point>|<significant digits>", or "zero") so two
rates can be compared without floats (netagent.rateAbove). Called with a dict:
  what      the value's path as the user wrote it, e.g. agent.defaultRate or classes[0] (bulk).spec.max
  value     the value (a number from --set is checked as the text it becomes)
  zero      true: zero is allowed (a guarantee, min); false: refused with zeroHint
  zeroHint  what to do instead of zero, e.g. "leave it out for no cap"
  suffix    added to the pattern's refusal, e.g. " (the agent's --default-rate)"
  unit      "bytes": a byte count instead (a quota's bytes: the same grammar, core.quantity.parse_bytes),
            below 2^63-1 bytes as the CRD's CEL bound is (the API server clamps larger amounts to 2^63-1)
tests/test_rate_grammar.py runs one table of strings through this, the parser and the CRDs;
tests/test_quota_crd.py the quotas' table (bytes, exhaustedRate, cost).
*/ -}}
{{- define "netagent.rate" -}}
{{- $rate := toString .value }}
{{- $what := .what }}
{{- $bytes := eq (toString .unit) "bytes" }}
{{- $expected := "expected a rate in bit/s as a Kubernetes quantity: a number with an optional suffix k, M, G, T, P, E (powers of 1000), Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or an exponent up to 30, e.g. 500k, 10M, 1.5G, 100Mi" }}
{{- if $bytes }}{{ $expected = "expected a byte count as a Kubernetes quantity: a number with an optional suffix k, M, G, T, P, E (powers of 1000), Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or an exponent up to 30, e.g. 500Gi, 50Ti, 50T; no units (50TB is 50T)" }}{{ end }}
{{- if gt (len $rate) 32 }}
{{- fail (printf "%s=%q is refused: longer than 32 characters; %s" $what $rate $expected) }}
{{- end }}
{{- if not (regexMatch "^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[kMGTPE]|[eE][+-]?0*([0-9]|[12][0-9]|30))?$" $rate) }}
{{- $hint := "" }}
{{- if regexMatch "(?i)^[0-9.]+ *[kmgt]?i?(bit|bps|b/s)" $rate }}{{ $hint = printf "; units are implied: write %s, not %s" (regexReplaceAll "(?i) *([kmgt]?i?)(bit|bps|b/s).*$" $rate "${1}" | replace "m" "M" | replace "g" "G" | replace "t" "T" | replace "K" "k") $rate }}{{ end }}
{{- if regexMatch "^[+]?[0-9.]+[mun]$" $rate }}{{ $hint = printf "; m means milli (10^-3), for mega%s write M" (ternary "byte" "bit" $bytes) }}{{ end }}
{{- fail (printf "%s=%q is refused: %s%s%s" $what $rate $expected $hint (.suffix | default "")) }}
{{- end }}
{{- if regexMatch "^[+]?(0+([.]0*)?|[.]0+)([^0-9.].*)?$" $rate }}
{{- if not .zero }}
{{- fail (printf "%s=%q is refused: it is zero; expected at least %s (%s)" $what $rate (ternary "1 byte, e.g. 50Ti" "1 bit/s, e.g. 1M" $bytes) .zeroHint) }}
{{- end }}
{{- print "zero" }}
{{- else }}
{{- /* at most 2^53 bit/s (8Pi, about 9P), as the parser, compared exactly: the value as digits and the
       position of its decimal point, against 2^53 (or, for a binary suffix, against 2^53 / 2^(10k)) */ -}}
{{- $number := regexFind "^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)" $rate }}
{{- $tail := trimPrefix $number $rate }}
{{- $parts := splitList "." (trimPrefix "+" $number) }}
{{- $whole := index $parts 0 }}
{{- $digits := $whole }}
{{- if gt (len $parts) 1 }}{{ $digits = print $whole (index $parts 1) }}{{ end }}
{{- $bound := dict "digits" "9007199254740992" "point" 16 }}
{{- /* bytes: below 2^63-1, so the bound itself is refused too ($atBound); with a binary suffix the exact
       2^(63-10k) - 2^(-10k), whose decimal digits end */ -}}
{{- $atBound := false }}
{{- if $bytes }}{{ $bound = dict "digits" "9223372036854775807" "point" 19 }}{{ $atBound = true }}{{ end }}
{{- $shift := 0 }}
{{- $binary := "" }}
{{- if regexMatch "^[eE][+-]?[0-9]" $tail }}  {{- /* an exponent, not the suffix Ei */ -}}
{{- $shift = atoi (substr 1 (len $tail) $tail) }}
{{- else if hasKey (dict "k" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18) $tail }}
{{- $shift = get (dict "k" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18) $tail }}
{{- else if $tail }}
{{- $binary = $tail }}
{{- $bound = get (dict "Ki" (dict "digits" "8796093022208" "point" 13) "Mi" (dict "digits" "8589934592" "point" 10) "Gi" (dict "digits" "8388608" "point" 7) "Ti" (dict "digits" "8192" "point" 4) "Pi" (dict "digits" "8" "point" 1) "Ei" (dict "digits" "78125" "point" -2)) $tail }}
{{- if $bytes }}
{{- $bound = get (dict "Ki" (dict "digits" "90071992547409919990234375" "point" 16) "Mi" (dict "digits" "879609302220799999904632568359375" "point" 13) "Gi" (dict "digits" "8589934591999999999068677425384521484375" "point" 10) "Ti" (dict "digits" "83886079999999999990905052982270717620849609375" "point" 7) "Pi" (dict "digits" "819199999999999999911182158029987476766109466552734375" "point" 4) "Ei" (dict "digits" "7999999999999999999132638262011596452794037759304046630859375" "point" 1)) $tail }}
{{- end }}
{{- end }}
{{- $significant := regexReplaceAll "^0+" $digits "" }}
{{- $point := sub (add (len $whole) $shift) (sub (len $digits) (len $significant)) | int }}
{{- $significant = regexReplaceAll "0+$" $significant "" }}
{{- $width := max (len $significant) (len $bound.digits) | int }}
{{- $padded := print $significant (repeat (sub $width (len $significant) | int) "0") }}
{{- $boundPadded := print $bound.digits (repeat (sub $width (len $bound.digits) | int) "0") }}
{{- $tooBig := or (gt $point (int $bound.point)) (and (eq $point (int $bound.point)) (or (gt $padded $boundPadded) (and $atBound (eq $padded $boundPadded)))) }}
{{- if and $tooBig $bytes }}
{{- fail (printf "%s=%q is refused: not below the largest byte count, 2^63-1 bytes (about 8Ei); expected e.g. 50Ti" $what $rate) }}
{{- end }}
{{- if $tooBig }}
{{- fail (printf "%s=%q is refused: above the largest rate, 8Pi (2^53) bit/s, about 9P; expected e.g. 1M" $what $rate) }}
{{- end }}
{{- /* the sort key: a binary suffix multiplied out exactly (2^(10k) as decimal digits) is not worth
       its code here; such a rate sorts by its value in decimal digits of float precision instead */ -}}
{{- if $binary }}
{{- $bits := mulf (float64 (print (default "0" $whole) "." (default "0" (index (append $parts "0") 1)))) (get (dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0) $binary) }}
{{- $text := printf "%.0f" $bits }}
{{- $sig := regexReplaceAll "0+$" $text "" }}
{{- printf "%d|%s" (len $text) $sig }}
{{- else }}
{{- printf "%d|%s" $point $significant }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
netagent.rateAbove: "true" when sort key `a` (from netagent.rate) is above `b`. Called with (list a b).
*/ -}}
{{- define "netagent.rateAbove" -}}
{{- $a := index . 0 }}{{- $b := index . 1 }}
{{- if eq $a "zero" }}false
{{- else if eq $b "zero" }}true
{{- else }}
{{- $ap := splitList "|" $a }}{{- $bp := splitList "|" $b }}
{{- $apoint := atoi (index $ap 0) }}{{- $bpoint := atoi (index $bp 0) }}
{{- if ne $apoint $bpoint }}{{ gt $apoint $bpoint }}
{{- else }}
{{- $ad := index $ap 1 }}{{- $bd := index $bp 1 }}
{{- $w := max (len $ad) (len $bd) | int }}
{{- gt (print $ad (repeat (sub $w (len $ad) | int) "0")) (print $bd (repeat (sub $w (len $bd) | int) "0")) }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
netagent.checkLimits: a min and a max (each optional) of a class, team or their ingress block: each a
rate (a min may be zero, a max not), and the min not above the max. Called with a dict: where (the
object's path), limits (the map holding them), minWhat and maxWhat (their keys as the user reads them,
e.g. ingress.min).
*/ -}}
{{- define "netagent.checkLimits" -}}
{{- $min := "" }}{{- $max := "" }}
{{- if hasKey .limits "min" }}
{{- $min = include "netagent.rate" (dict "what" (printf "%s.%s" .where .minWhat) "value" .limits.min "zero" true) }}
{{- end }}
{{- if hasKey .limits "max" }}
{{- $max = include "netagent.rate" (dict "what" (printf "%s.%s" .where .maxWhat) "value" .limits.max "zero" false "zeroHint" "leave it out for no cap") }}
{{- end }}
{{- if and $min $max (eq (include "netagent.rateAbove" (list $min $max)) "true") }}
{{- fail (printf "%s.%s=%v is refused: above %s.%s=%v; a guarantee cannot exceed the cap, e.g. min: 5M with max: 20M" .where .minWhat .limits.min .where .maxWhat .limits.max) }}
{{- end }}
{{- end }}

{{- /*
netagent.checkQuota: a team's quota block (docs/quotas.md) as the CRD's rules check it: bytes and
ingress.bytes byte counts, exhaustedRate and ingress.exhaustedRate rates above zero and not above the
team's max / ingress.max, cost a decimal above zero; at least one of bytes, ingress.bytes, cost; an
exhaustedRate only with bytes or cost (the period: values.schema.json). Called with a dict: where (the
quota's path), quota, team.
*/ -}}
{{- define "netagent.checkQuota" -}}
{{- $q := .quota }}{{- $where := .where }}{{- $team := .team }}
{{- $in := $q.ingress | default dict }}
{{- range $field, $block := dict "bytes" $q "ingress.bytes" $in }}
{{- if hasKey $block "bytes" }}
{{- $_ := include "netagent.rate" (dict "what" (printf "%s.%s" $where $field) "value" $block.bytes "zero" false "zeroHint" "leave the quota out for no quota" "unit" "bytes") }}
{{- end }}
{{- end }}
{{- range $field, $pair := dict "exhaustedRate" (list $q $team "max") "ingress.exhaustedRate" (list $in ($team.ingress | default dict) "ingress.max") }}
{{- $block := index $pair 0 }}{{- $limits := index $pair 1 }}{{- $maxWhat := index $pair 2 }}
{{- if hasKey $block "exhaustedRate" }}
{{- $rate := include "netagent.rate" (dict "what" (printf "%s.%s" $where $field) "value" $block.exhaustedRate "zero" false "zeroHint" "leave it out for only the safe floor once the quota is spent") }}
{{- if hasKey $limits "max" }}
{{- $max := include "netagent.rate" (dict "what" "max" "value" $limits.max "zero" false) }}
{{- if eq (include "netagent.rateAbove" (list $rate $max)) "true" }}
{{- fail (printf "%s.%s=%v is refused: above the team's %s=%v; the exhausted rate must not be above its max, e.g. 10M" $where $field $block.exhaustedRate $maxWhat $limits.max) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if hasKey $q "cost" }}
{{- $cost := toString $q.cost }}
{{- if or (gt (len $cost) 32) (not (regexMatch "^[0-9]+([.][0-9]+)?$" $cost)) }}
{{- fail (printf "%s.cost=%q is refused: expected money in the NetworkScopes currency as a decimal string of at most 32 characters, e.g. \"5000\" or \"99.50\"" $where $cost) }}
{{- end }}
{{- if regexMatch "^0+([.]0+)?$" $cost }}
{{- fail (printf "%s.cost=%q is refused: it is zero; leave it out for no cost quota, e.g. \"5000\"" $where $cost) }}
{{- end }}
{{- end }}
{{- if not (or (hasKey $q "bytes") (hasKey $in "bytes") (hasKey $q "cost")) }}
{{- fail (printf "%s is refused: a quota needs bytes (uploads), ingress.bytes (downloads) or cost, e.g. bytes: 50Ti" $where) }}
{{- end }}
{{- if and (hasKey $q "exhaustedRate") (not (or (hasKey $q "bytes") (hasKey $q "cost"))) }}
{{- fail (printf "%s.exhaustedRate is refused: it needs bytes or cost beside it (ingress.exhaustedRate goes with ingress.bytes), e.g. bytes: 50Ti" $where) }}
{{- end }}
{{- end }}
