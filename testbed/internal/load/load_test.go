package load

import (
	"context"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestConstantSchedule(t *testing.T) {
	s, err := NewSchedule(200, 2*time.Second, Constant, rand.New(rand.NewPCG(1, 2)))
	if err != nil {
		t.Fatal(err)
	}
	var times []time.Duration
	for at, ok := s.Next(); ok; at, ok = s.Next() {
		times = append(times, at)
	}
	if len(times) != 400 {
		t.Fatalf("%d sends, want 200/s x 2s = 400", len(times))
	}
	for i, at := range times {
		if want := time.Duration(i) * 5 * time.Millisecond; at != want {
			t.Fatalf("send %d at %s, want %s", i, at, want)
		}
	}
}

func TestPoissonScheduleRate(t *testing.T) {
	s, _ := NewSchedule(500, 60*time.Second, Poisson, rand.New(rand.NewPCG(7, 7)))
	n := 0
	for _, ok := s.Next(); ok; _, ok = s.Next() {
		n++
	}
	if math.Abs(float64(n)-30000) > 4*math.Sqrt(30000) { // a Poisson count: sd = sqrt(mean)
		t.Fatalf("%d arrivals in 60s at 500/s", n)
	}
}

func TestScheduleRejectsBadInput(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	for _, c := range []struct {
		rate     float64
		d        time.Duration
		arrivals string
	}{{0, time.Second, Constant}, {10, 0, Constant}, {10, time.Second, "bursty"}} {
		if _, err := NewSchedule(c.rate, c.d, c.arrivals, rng); err == nil {
			t.Fatalf("accepted %+v", c)
		}
	}
}

func TestParseMixAndPick(t *testing.T) {
	m, err := ParseMix(DefaultMix)
	if err != nil {
		t.Fatal(err)
	}
	p := newPicker(m)
	rng := rand.New(rand.NewPCG(3, 4))
	counts := map[string]int{}
	for range 100000 {
		counts[p.pick(rng)]++
	}
	for kind, share := range map[string]float64{Compose: 0.1, User: 0.3, Home: 0.6} {
		if got := float64(counts[kind]) / 100000; math.Abs(got-share) > 0.01 {
			t.Fatalf("%s drawn %.3f of the time, want %.2f", kind, got, share)
		}
	}
	only, _ := ParseMix("home=1,compose=0")
	for range 1000 {
		if k := newPicker(only).pick(rng); k != Home {
			t.Fatalf("a kind of share 0 was drawn: %s", k)
		}
	}
	for _, bad := range []string{"", "home", "home=x", "home=-1", "shout=1", "home=0"} {
		if _, err := ParseMix(bad); err == nil {
			t.Fatalf("mix %q accepted", bad)
		}
	}
}

// Open loop: requests leave on schedule although the server holds each for 300ms; a closed
// loop of one client would have sent 3. Latencies count from the scheduled time.
func TestLoadIsOpenLoop(t *testing.T) {
	var mu sync.Mutex
	var arrivals []time.Time
	var concurrent, peak atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		arrivals = append(arrivals, time.Now())
		mu.Unlock()
		n := concurrent.Add(1)
		for m := peak.Load(); n > m && !peak.CompareAndSwap(m, n); m = peak.Load() {
		}
		time.Sleep(300 * time.Millisecond)
		concurrent.Add(-1)
		w.Write([]byte("{}"))
	}))
	defer ts.Close()
	mix, _ := ParseMix(DefaultMix)
	sum, err := Run(context.Background(), Options{Target: ts.URL, Rate: 50, Duration: time.Second, Mix: mix,
		Arrivals: Constant, Seed: 1, Users: 10, Follows: 2, Timeout: 5 * time.Second, MaxInFlight: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Sent != 50 || sum.OK != 50 || sum.Errors != 0 {
		t.Fatalf("sent %d ok %d errors %d, want 50 sent on schedule", sum.Sent, sum.OK, sum.Errors)
	}
	mu.Lock()
	spread := arrivals[len(arrivals)-1].Sub(arrivals[0])
	mu.Unlock()
	if spread > 1300*time.Millisecond {
		t.Fatalf("50 requests due within 1s arrived over %s: the generator waited for answers", spread)
	}
	if peak.Load() < 10 {
		t.Fatalf("at most %d requests in flight: not open loop", peak.Load())
	}
	if sum.P50MS < 300 {
		t.Fatalf("p50 %.1fms below the server's 300ms hold", sum.P50MS)
	}
	if got := sum.ByKind[Compose].Sent + sum.ByKind[Home].Sent + sum.ByKind[User].Sent; got != 50 {
		t.Fatalf("by kind adds to %d", got)
	}
}

func TestLoadStopsOnContextAndCountsErrors(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "boom", http.StatusInternalServerError)
	}))
	defer ts.Close()
	mix, _ := ParseMix("home=1")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	sum, err := Run(ctx, Options{Target: ts.URL, Rate: 100, Duration: time.Minute, Mix: mix, Arrivals: Poisson,
		Seed: 1, Users: 10, Timeout: time.Second, MaxInFlight: 100})
	if err != nil {
		t.Fatal(err)
	}
	if !sum.Stopped || sum.Seconds > 5 {
		t.Fatalf("did not stop early: %+v", sum)
	}
	if sum.Sent == 0 || sum.Errors != sum.Sent || len(sum.ErrorSamples) == 0 {
		t.Fatalf("errors not counted: %+v", sum)
	}
}

func TestInitComposesPostsAfterTheFollows(t *testing.T) {
	var mu sync.Mutex
	var paths []string
	composers := map[string]int{}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseForm(); err != nil {
			t.Error(err)
		}
		mu.Lock()
		paths = append(paths, r.URL.Path)
		if r.URL.Path == "/wrk2-api/post/compose" {
			composers[r.PostForm.Get("user_id")]++
		}
		mu.Unlock()
		w.Write([]byte("{}"))
	}))
	defer ts.Close()
	mix, _ := ParseMix("home=1")
	sum, err := Run(context.Background(), Options{Target: ts.URL, Rate: 1, Duration: time.Millisecond, Mix: mix,
		Arrivals: Constant, Seed: 1, Users: 6, Init: true, Follows: 2, Posts: 3, Timeout: time.Second, MaxInFlight: 10})
	if err != nil {
		t.Fatal(err)
	}
	if sum.Init == nil || sum.Init.Posts != 18 || sum.Init.Follows != 12 || sum.Init.Reads != 12 || sum.Init.Errors != 0 {
		t.Fatalf("init %+v, want 12 follows, 18 posts and 12 timeline reads", sum.Init)
	}
	mu.Lock()
	defer mu.Unlock()
	for id := 1; id <= 6; id++ {
		if got := composers[strconv.Itoa(id)]; got != 3 {
			t.Fatalf("user %d composed %d posts at init, want 3", id, got)
		}
	}
	lastFollow, firstPost := -1, len(paths)
	for i, p := range paths {
		if p == "/wrk2-api/user/follow" {
			lastFollow = i
		}
		if p == "/wrk2-api/post/compose" && i < firstPost {
			firstPost = i
		}
	}
	lastPost := -1
	for i, p := range paths {
		if p == "/wrk2-api/post/compose" {
			lastPost = i
		}
	}
	read := map[string]int{}
	for _, p := range paths[lastPost+1:] {
		read[p]++
	}
	// each user's two timelines (16 at a time, in any order); the run's own requests are home reads
	if read["/wrk2-api/user-timeline/read"] != 6 || read["/wrk2-api/home-timeline/read"] < 6 {
		t.Fatalf("after the posts %v, want each user's home and user timeline read", read)
	}
	if lastFollow > firstPost {
		t.Fatalf("a post (request %d) before the last follow (request %d): it would miss followers' timelines", firstPost, lastFollow)
	}
}

func TestOptionsValidate(t *testing.T) {
	mix, _ := ParseMix(DefaultMix)
	good := Options{Target: "http://127.0.0.1:1", Rate: 1, Duration: time.Second, Mix: mix, Arrivals: Constant,
		Users: 10, Follows: 3, Timeout: time.Second, MaxInFlight: 1}
	if err := good.validate(); err != nil {
		t.Fatal(err)
	}
	for _, mutate := range []func(*Options){
		func(o *Options) { o.Target = "127.0.0.1:80" },
		func(o *Options) { o.Users = 1 },
		func(o *Options) { o.Follows = 10 },
		func(o *Options) { o.Posts = -1 },
		func(o *Options) { o.MaxInFlight = 0 },
		func(o *Options) { o.Mix = Mix{} },
	} {
		o := good
		mutate(&o)
		if o.validate() == nil {
			t.Fatalf("accepted %+v", o)
		}
	}
}
