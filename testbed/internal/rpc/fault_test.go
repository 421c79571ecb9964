package rpc

import (
	"math"
	"testing"
)

func TestFaultsSetAndClear(t *testing.T) {
	var f Faults
	if f.Mode("a", "b") != FaultNone {
		t.Fatal("no fault at first")
	}
	f.Set("b", FaultError, 1)
	if got := f.Mode("a", "b"); got != FaultError {
		t.Fatalf("got %q", got)
	}
	f.Set("a", FaultReturn, 1)
	if got := f.Mode("a", "b"); got != FaultReturn {
		t.Fatalf("the first name wins: got %q", got)
	}
	f.Set("a", FaultNone, 1)
	f.Set("b", FaultNone, 1)
	if len(f.Active()) != 0 || f.Mode("a", "b") != FaultNone {
		t.Fatalf("not cleared: %v", f.Active())
	}
	for _, bad := range []string{"", "Error", "slow"} {
		if _, err := ParseFaultMode(bad); err == nil {
			t.Fatalf("mode %q accepted", bad)
		}
	}
}

func TestFaultShareHitsThatShareOfEveryRun(t *testing.T) {
	for _, share := range []float64{0.01, 0.05, 0.1, 0.25, 1.0 / 3, 0.5, 0.9, 1} {
		var f Faults
		f.Set("op", FaultError, share)
		hits := make([]bool, 2000)
		for i := range hits {
			hits[i] = f.Mode("op") == FaultError
		}
		// every window of k consecutive requests holds k x share hits, give or take one
		for _, k := range []int{1, 7, 20, 100, 2000} {
			for start := 0; start+k <= len(hits); start += k {
				n := 0
				for _, h := range hits[start : start+k] {
					if h {
						n++
					}
				}
				if want := float64(k) * share; math.Abs(float64(n)-want) > 1 {
					t.Fatalf("share %v: %d hits in requests %d-%d, want %.1f +- 1", share, n, start, start+k, want)
				}
			}
		}
		got := f.Active()["op"]
		if got.Seen != 2000 || float64(got.Hit) != math.Floor(2000*share) {
			t.Fatalf("share %v: seen %d hit %d", share, got.Seen, got.Hit)
		}
	}
}

func TestFaultShareOneHitsEveryRequestAndSetRestartsTheCount(t *testing.T) {
	var f Faults
	f.Set("op", FaultReturn, 1)
	for i := 0; i < 50; i++ {
		if f.Mode("op") != FaultReturn {
			t.Fatalf("request %d not hit at share 1", i)
		}
	}
	f.Set("op", FaultReturn, 0.5)
	if got := f.Active()["op"]; got.Seen != 0 || got.Share != 0.5 {
		t.Fatalf("a fault set again starts afresh: %+v", got)
	}
	for _, bad := range []float64{0, -0.1, 1.01, math.NaN()} {
		if ParseFaultShare(bad) == nil {
			t.Fatalf("share %v accepted", bad)
		}
	}
}
